"""Experiment, not used by the engine: a Triton GEMM for decode's few rows, y = x @ W.T with x
[M <= 16, K] and W [N, K] (a Linear's weight), against cuBLAS. At M = 8 a decode step is ~86 %
cuBLAS streaming the weights at ~77 % of HBM bandwidth (docs/benchmarks.md, session 7); this asks
whether a kernel that does nothing but stream W (no split-K, so no reduce launch) gets closer.

Each program owns BLOCK_N output columns and walks all of K in BLOCK_K steps: one [16, BLOCK_K]
tile of x (rows past M masked) and one [BLOCK_N, BLOCK_K] tile of W per step, a tensor-core dot
into an fp32 [16, BLOCK_N] accumulator, rounded once to the output dtype (as cuBLAS without
split-K). Small BLOCK_N gives N / BLOCK_N programs: 256 for N = 4096 at BLOCK_N = 16.

    PYTHONPATH=. python3 benchmarks/skinny_gemm.py [--json out.json]      # CUDA: time configs
CPU (TRITON_INTERPRET=1): tests/bench/test_skinny_gemm.py checks it against torch.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.gemm_choices import SHAPES as DECODE_SHAPES

# (BLOCK_N, BLOCK_K, num_stages, num_warps) tried on the GPU
CONFIGS = [(16, 512, 4, 4), (16, 256, 6, 4), (32, 256, 4, 4), (32, 512, 3, 8), (64, 128, 5, 4)]
SHAPES = {k: v for k, v in DECODE_SHAPES.items() if k != "lm_head"}  # the 32 layers' GEMMs


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    rows = tl.arange(0, 16)
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=(cols < N)[:, None] & (ks < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: tuple[int, int, int, int] = CONFIGS[0]) -> torch.Tensor:
    """x [M <= 16, K] @ w [N, K].T -> [M, N] in x's dtype (contiguous last dims)."""
    M, K = x.shape
    N = w.shape[0]
    if not (M <= 16 and w.shape[1] == K and x.stride(1) == 1 and w.stride(1) == 1):
        raise ValueError(f"skinny_gemm needs x [M <= 16, K] and w [N, K] with contiguous rows, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    bn, bk, stages, warps = config
    _skinny_gemm_kernel[(triton.cdiv(N, bn),)](x, w, out, M, N, K, x.stride(0), w.stride(0),
                                               out.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                               num_stages=stages, num_warps=warps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    dt, dev, rows = torch.bfloat16, "cuda", []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        x = torch.randn(a.m, k, device=dev, dtype=dt)
        out = torch.empty(a.m, n, device=dev, dtype=dt)
        ref = torch.mm(x, w.t())
        nbytes = (n * k + a.m * k + a.m * n) * 2
        torch.cuda.synchronize()
        cases = {"cublas": lambda: torch.mm(x, w.t(), out=out)}
        for c in CONFIGS:
            cases[f"triton {c}"] = (lambda c=c: skinny_gemm(x, w, out, c))
        for label, fn in cases.items():
            fn()
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            us = triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3
            rows.append({"gemm": name, "M": a.m, "N": n, "K": k, "case": label, "us": round(us, 2),
                         "frac_of_4_2TBps": round(nbytes / (us * 1e-6) / 4.2e12, 3),
                         "max_abs_diff_vs_cublas": err})
            print(f"{name:8s} {label:28s} {us:8.2f} us ({nbytes / (us * 1e-6) / 4.2e12:5.1%} of "
                  f"4.2 TB/s) maxdiff {err:.3g}")
    best = {}
    for r in rows:
        key = (r["gemm"], r["case"].startswith("triton"))
        best[key] = min(best.get(key, 1e9), r["us"])
    cub = sum(best[(g, False)] for g in SHAPES) * 32
    tri = sum(best[(g, True)] for g in SHAPES) * 32
    print(f"M={a.m}: 32 layers' GEMMs, cuBLAS {cub:.0f} us vs best Triton config per shape {tri:.0f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "weights": "random", "rows": rows,
                       "cublas_us": cub, "triton_best_us": tri}, f, indent=1)


if __name__ == "__main__":
    main()
