"""y = (x_q * x_scale) @ (w_q * w_scale).T (+ bias): batchrun's FP8 e4m3 scaled GEMM.

Scales per row of x and per output column (row-wise: [M, 1] and [N]), or per row and group of
GROUP_K columns of x with one scale per [GROUP_N, GROUP_K] block of w (block-scaled checkpoints:
Qwen3-FP8, DeepSeek). FP8 tensor-core dots with fp32 accumulators, each BLOCK_K tile's sum added
in fp32: row-wise scales multiply the finished sum once; block scales multiply each K group's
partial sum (BLOCK_K = GROUP_K). Bias added in fp32, one rounding to the output dtype. Reference: kernels/reference.py ref_fp8_linear
(over already quantized inputs: ref_dequant_fp8 of both operands).

Two tilings, chosen from M only: at decode's M <= 16 rows one [16, BLOCK_N] tile per program
covers every row, so the grid walks N and each e4m3 weight byte is read once (the decode step is
bound by streaming the weights); larger M takes [64, 128] tiles over both dimensions. Grids come
from static shapes: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.utils import HALF_DTYPES, check

SKINNY_ROWS = 16
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): decode (M <= 16) and the rest
SKINNY = (16, 64, 128, 4, 4)
TILED = (64, 128, 128, 3, 8)


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_am,
                     stride_bn, stride_cm, stride_asm, stride_bsn,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k < K)[None, :]
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok, other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok, other=0.0)
        if GROUP_K > 0:  # block scales: each K group's partial sum times its two scales
            g = k0 // GROUP_K
            a_s = tl.load(as_ptr + rows * stride_asm + g, mask=row_ok, other=0.0)
            b_s = tl.load(bs_ptr + (cols // GROUP_N) * stride_bsn + g, mask=col_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        else:
            # Hopper's FP8 tensor cores (wgmma) keep ~14 bits of the running sum, and Triton lets
            # them run the whole K loop at that precision unless told otherwise, so the error
            # grows with K. Adding each BLOCK_K tile's sum into the fp32 accumulator bounds it,
            # as DeepSeek-V3 and CUTLASS's non-fast-accum mode do.
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GROUP_K == 0:  # row-wise: the finished sum times the row's and the column's scale
        a_s = tl.load(as_ptr + rows * stride_asm, mask=row_ok, other=0.0)
        b_s = tl.load(bs_ptr + cols, mask=col_ok, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_gemm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, bias: Tensor | None,
             out_dtype: torch.dtype, block: tuple[int, int] | None = None,
             config: tuple[int, int, int, int, int] | None = None) -> Tensor:
    # a: e4m3 [M, K], a_scale fp32 [M, 1] (row-wise) or [M, ceil(K/bk)] (block);
    # b: e4m3 [N, K], b_scale fp32 [N] or [ceil(N/bn), ceil(K/bk)] with block (bn, bk);
    # bias [N] or None -> [M, N] in out_dtype; config: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages,
    # num_warps) in place of SKINNY / TILED, for benchmarks/kernels.py fp8 --sweep
    fp8 = torch.float8_e4m3fn
    check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1] and a.dtype == fp8
          and b.dtype == fp8 and a.stride(1) == 1 and b.stride(1) == 1,
          f"fp8_gemm needs e4m3 a [M, K] and b [N, K] with contiguous rows, got "
          f"{tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    M, K = a.shape
    N = b.shape[0]
    check(out_dtype in HALF_DTYPES + (torch.float32,), f"unsupported output dtype {out_dtype}")
    check(a_scale.dtype == b_scale.dtype == torch.float32, "fp8_gemm scales must be fp32")
    if block is None:
        check(a_scale.shape == (M, 1) and b_scale.shape == (N,),
              f"row-wise scales must be [{M}, 1] and [{N}], got {tuple(a_scale.shape)} and "
              f"{tuple(b_scale.shape)}")
        group_n, group_k = 1, 0
    else:
        group_n, group_k = block
        check(a_scale.shape == (M, triton.cdiv(K, group_k))
              and b_scale.shape == (triton.cdiv(N, group_n), triton.cdiv(K, group_k)),
              f"block scales must be [{M}, {triton.cdiv(K, group_k)}] and "
              f"[{triton.cdiv(N, group_n)}, {triton.cdiv(K, group_k)}], got "
              f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
        check(group_k >= 16 and group_k & (group_k - 1) == 0,
              f"block columns must be a power of two >= 16, got {group_k}")
    check(bias is None or (bias.shape == (N,) and bias.stride(0) == 1),
          f"bias must be a contiguous [{N}]")
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    bm, bn, bk, stages, warps = config or (SKINNY if M <= SKINNY_ROWS else TILED)
    if group_k:
        bk = group_k
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    _fp8_gemm_kernel[grid](
        a, a_scale, b, b_scale, out if bias is None else bias, out, M, N, K, a.stride(0),
        b.stride(0), out.stride(0), a_scale.stride(0), b_scale.stride(0),
        GROUP_N=group_n, GROUP_K=group_k, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, num_stages=stages, num_warps=warps)
    return out
