"""cuBLAS and the Triton skinny GEMM at 8 rows on o_proj / down_proj's LoRA-stacked shapes.

On a LoRA step of a decode graph set with slot bound k, o_proj and down_proj run one GEMM over
[W; A]: N = 4096 + 16 k rows (rank 16), so 4112 at bound 1 and 4224 at bound 8. cuBLAS picks
its algorithm per card and shape; an odd N could get a poor one on one card and not on another.
Every H200 run measured a higher absolute LoRA cost at 1 active than the H100 (52-73 against
44-61 ms a request, docs/benchmarks.md, session 18); this times the shapes with each weight
cold in L2 (narrow_gemm.py's copies, timed inside one CUDA graph) to confirm or rule out that
cause.

    PYTHONPATH=. python3 benchmarks/stacked_gemm.py

RANDOM bf16 weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchrun.kernels.skinny_gemm import skinny_gemm
from benchmarks.narrow_gemm import cold_copies
from benchmarks.skinny_gemm import bench  # one case, timed inside a CUDA graph, µs


def main() -> None:
    dt = torch.bfloat16
    print(f"{torch.cuda.get_device_name()}; RANDOM bf16 weights; M = 8; µs per GEMM, weight cold")
    for k in (4096, 11008):
        for n in (4096, 4112, 4224):
            ws = cold_copies(n, k, dt)
            x = torch.randn(8, k, device="cuda", dtype=dt)
            res = []
            for label, f in (("cublas", lambda w: F.linear(x, w)),
                             ("triton", lambda w: skinny_gemm(x, w))):
                us = bench(lambda f=f: [f(w) for w in ws]) / len(ws)
                res.append(f"{label} {us:7.2f} us {n * k * 2 / us / 1e6:5.2f} TB/s")
            print(f"M 8 N {n:5d} K {k:5d}: " + " | ".join(res), flush=True)


if __name__ == "__main__":
    main()
