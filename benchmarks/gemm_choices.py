"""The decode GEMMs of a Llama-2-7b layer (and lm_head) under the cuBLAS choices torch exposes:
which one streams the weights fastest at the latency batch (M = 8) and at throughput (M = 256)?
Each is timed inside a CUDA graph (as decode replays them), in µs, with the bytes it must read
(weights + activations) as GB/s and the fraction of 4.2 TB/s.

    PYTHONPATH=. python3 benchmarks/gemm_choices.py [--json out.json]

Variants: torch's default backend (cuBLAS); the cuBLASLt backend
(torch.backends.cuda.preferred_blas_library); reduced-precision bf16 reductions off
(allow_bf16_reduced_precision_reduction, which limits split-K). RANDOM bf16 weights.
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
import triton

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
          "down": (4096, 11008), "lm_head": (32000, 4096)}
PEAK = 4.2e12


@contextlib.contextmanager
def variant(name: str):
    m = torch.backends.cuda.matmul
    saved = (torch.backends.cuda.preferred_blas_library(), m.allow_bf16_reduced_precision_reduction)
    try:
        if name == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        elif name == "no_reduced_bf16":
            m.allow_bf16_reduced_precision_reduction = False
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved[0])
        m.allow_bf16_reduced_precision_reduction = saved[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    dt, dev = torch.bfloat16, "cuda"
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        for m in (8, 256):
            x = torch.randn(m, k, device=dev, dtype=dt)
            out = torch.empty(m, n, device=dev, dtype=dt)
            ref = F.linear(x, w)
            for v in ("default", "cublaslt", "no_reduced_bf16"):
                with variant(v):
                    torch.mm(x, w.t(), out=out)  # warm-up: the heuristic picks its kernel
                    torch.cuda.synchronize()
                    us = triton.testing.do_bench_cudagraph(lambda: torch.mm(x, w.t(), out=out),
                                                          rep=50) * 1e3
                err = (out.float() - ref.float()).abs().max().item()
                nbytes = (n * k + m * k + m * n) * 2
                rows.append({"gemm": name, "M": m, "N": n, "K": k, "variant": v, "us": round(us, 2),
                             "GBps": round(nbytes / us / 1e3), "frac_of_4_2TBps":
                             round(nbytes / (us * 1e-6) / PEAK, 3), "max_abs_diff_vs_default": err})
                print(f"{name:8s} M={m:<4d} {v:16s} {us:8.2f} us  {nbytes / us / 1e3:7.0f} GB/s "
                      f"({nbytes / (us * 1e-6) / PEAK:5.1%})  maxdiff {err:.3g}")
    for m in (8, 256):
        tot = {v: sum(r["us"] * (32 if r["gemm"] != "lm_head" else 1) for r in rows
                      if r["M"] == m and r["variant"] == v)
               for v in ("default", "cublaslt", "no_reduced_bf16")}
        print(f"M={m}: one decode step's GEMMs (32 layers + lm_head), µs: "
              + ", ".join(f"{v} {t:.0f}" for v, t in tot.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "weights": "random", "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
