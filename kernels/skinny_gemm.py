"""y = x @ W.T (+ bias) for decode's few rows: a GEMM that does nothing but stream W.

At M <= 16 rows a decode GEMM is bound by reading the weight once from HBM. cuBLAS reaches
75-88 % of the copy rate there and splits K over programs for the narrower weights, which costs
a second (reduce) launch per GEMM. This kernel gives each program BLOCK_N output columns and
walks all of K: one [16, BLOCK_K] tile of x (rows past M masked; x is a few KB and stays in L2)
and one [BLOCK_N, BLOCK_K] tile of W per step, a tensor-core dot into an fp32 [16, BLOCK_N]
accumulator, bias added in fp32, rounded once to the output dtype (what cuBLAS without split-K
computes). One launch, no workspace; grid from static shapes, so CUDA-graph capturable.

Each output column is the same sum whatever N is, so the columns W shares with a longer
stacked weight (LoRA's [W; A] rows) come out bit-identical in both GEMMs.

`_stream_dot` is the K loop, shared with kernels/skinny_gate_up_silu.py.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.pdl import PREFETCH_COLS, pdl_enter, pdl_kwargs, prefetch_rows_l2
from batchrun.kernels.utils import check, check_gemm_operands, gemm_output

MAX_ROWS = 16  # x's rows: one tl.dot tile (its minimum M)
# (BLOCK_N, BLOCK_K, num_stages, num_warps): the fastest of the configurations
# `benchmarks/kernels.py gemm --sweep` times for the 7b / 8b decode shapes at M = 1, 8, 16
CONFIG = (32, 128, 6, 4)


@triton.jit
def _stream_dot(acc, x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_wn,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # acc [16, BLOCK_N] fp32 += x[rows, :K] @ w[cols, :K].T
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    row_mask, col_mask = (rows < M)[:, None], (cols < N)[:, None]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask, other=0.0)
            w = tl.load(w_ptrs, mask=col_mask, other=0.0)
        else:
            k_mask = (k0 + offs_k < K)[None, :]
            x = tl.load(x_ptrs, mask=row_mask & k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=col_mask & k_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, PDL: tl.constexpr):
    rows = tl.arange(0, 16)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PDL:  # W streams while the kernel before still runs (kernels/pdl.py)
        prefetch_rows_l2(w_ptr, cols, stride_wn, N, K, PREFETCH_COLS)
    pdl_enter(PDL)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc = _stream_dot(acc, x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_wn, BLOCK_K,
                      EVEN_K)
    col_mask = cols < N
    if HAS_BIAS:  # in fp32, rounded once with the sum
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & col_mask[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


def skinny_gemm(x: Tensor, w: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
                config: tuple[int, int, int, int] = CONFIG) -> Tensor:
    # x [M <= 16, K] @ w [N, K].T (+ bias [N]) -> [M, N] in x's dtype
    M, N, K = check_gemm_operands(x, w, "skinny_gemm", MAX_ROWS)
    out = gemm_output(x, out, M, N)
    check(bias is None or (bias.shape == (N,) and bias.stride(0) == 1),
          f"bias must be a contiguous [{N}], got {None if bias is None else tuple(bias.shape)}")
    if M == 0 or N == 0:
        return out
    bn, bk, stages, warps = config
    _skinny_gemm_kernel[(triton.cdiv(N, bn),)](
        x, w, x if bias is None else bias, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0,
        num_stages=stages, num_warps=warps, **pdl_kwargs(x))
    return out
