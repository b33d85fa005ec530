"""The decode GEMMs of few rows: cuBLAS against batchrun's Triton skinny GEMM
(kernels/skinny_gemm.py) and, for gate_up, cuBLAS + the SiLU-and-mul kernel against the GEMM with
SiLU in its epilogue (kernels/skinny_gate_up_silu.py). Each case is timed inside a CUDA graph (as
decode replays them), in us, with the fraction of 4.2 TB/s its bytes (W + x + y) reach, at
M = 1, 8 and 16, for the Llama-2-7b and Llama-3-8b shapes. RANDOM bf16 weights.

    PYTHONPATH=. python3 benchmarks/skinny_gemm.py [--m 1 8 16] [--json out.json]

The engine's rule (batchrun/engine/layers/gemm.py: Triton when the weight has >= 32M elements)
is what the summary line prices: one 7b decode step's layer GEMMs, cuBLAS vs the rule.
CPU (TRITON_INTERPRET=1): tests/kernels/test_skinny_gemm.py checks the kernels against torch.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from batchrun.engine.step_plan import MIN_WEIGHT_ELEMENTS
from batchrun.kernels.silu_and_mul import silu_and_mul
from batchrun.kernels.skinny_gate_up_silu import CONFIG as FUSED_CONFIG, skinny_gate_up_silu
from batchrun.kernels.skinny_gemm import CONFIG, skinny_gemm

# (BLOCK_N, BLOCK_K, num_stages, num_warps) tried besides the defaults
CONFIGS = [CONFIG, (32, 256, 4, 4), (16, 512, 4, 4), (64, 128, 5, 4), (32, 128, 4, 4)]
FUSED_CONFIGS = [FUSED_CONFIG, (16, 256, 4, 4), (32, 128, 6, 4), (32, 256, 4, 4)]
SHAPES = {"7b qkv": (12288, 4096), "7b o": (4096, 4096), "7b gate_up": (22016, 4096),
          "7b down": (4096, 11008), "7b lm_head": (32000, 4096), "8b qkv": (6144, 4096),
          "8b gate_up": (28672, 4096), "8b down": (4096, 14336)}
STEP_7B = ("7b qkv", "7b o", "7b gate_up", "7b down")  # a layer's GEMMs (+ lm_head once)


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=40) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--json")
    a = ap.parse_args()
    dt, dev, rows = torch.bfloat16, "cuda", []
    print(f"{torch.cuda.get_device_name()}; RANDOM bf16 weights; us (fraction of 4.2 TB/s)")
    for m in a.m:
        step = {"cublas": 0.0, "rule": 0.0}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = F.linear(x, w)
            nbytes = (n * k + m * k + m * n) * 2
            cases = {"cublas": lambda: F.linear(x, w)}
            for c in CONFIGS:
                cases[f"triton {c}"] = lambda c=c: skinny_gemm(x, w, config=c)
            if "gate_up" in name:
                cases["cublas + silu_and_mul"] = lambda: silu_and_mul(F.linear(x, w))
                for c in FUSED_CONFIGS:
                    cases[f"fused {c}"] = lambda c=c: skinny_gate_up_silu(x, w, config=c)
            res = {}
            for label, fn in cases.items():
                us = bench(fn)
                out = fn()
                if label.startswith("triton"):
                    err = (out.float() - ref.float()).abs().max().item()
                elif label.startswith("fused"):
                    err = (out.float() - silu_and_mul(ref).float()).abs().max().item()
                else:
                    err = 0.0
                res[label] = us
                rows.append({"gemm": name, "M": m, "N": n, "K": k, "case": label, "us": round(us, 2),
                             "frac_of_4_2TBps": round(nbytes / (us * 1e-6) / 4.2e12, 3),
                             "max_abs_diff_vs_cublas": err})
                print(f"M={m:<3d}{name:11s} {label:30s} {us:8.2f} us ({nbytes / (us * 1e-6) / 4.2e12:6.1%})"
                      f" maxdiff {err:.3g}")
            if name in STEP_7B:
                gate_up = "gate_up" in name
                base = res["cublas + silu_and_mul"] if gate_up else res["cublas"]
                ours = res[f"fused {FUSED_CONFIG}"] if gate_up else res[f"triton {CONFIG}"]
                step["cublas"] += 32 * base
                step["rule"] += 32 * (ours if n * k >= MIN_WEIGHT_ELEMENTS else base)
            elif name == "7b lm_head":
                step["cublas"] += res["cublas"]
                step["rule"] += res[f"triton {CONFIG}"]
        print(f"M={m}: 7b step, 32 layers' GEMMs (+ SiLU-and-mul) and lm_head: cuBLAS {step['cublas']:.0f} us, "
              f"engine rule {step['rule']:.0f} us ({step['rule'] - step['cublas']:+.0f} us)")
        rows.append({"M": m, "step_7b_us": step})
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "weights": "random", "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
