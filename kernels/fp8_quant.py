"""Quantize activations to FP8 e4m3 for a scaled GEMM: x [M, K] -> (x_q e4m3 [M, K], scales fp32).

One program per (row, group of GROUP columns): dynamic scales are the group's amax / 448 (floored
at FP8_MIN_SCALE, so an all-zero row divides by a positive number), written per row ([M, 1],
GROUP = K) or per row and group ([M, ceil(K / GROUP)]); a static scale (the checkpoint's
input_scale) is used as given and written to every row of [M, 1], the layout
torch._scaled_mm's row-wise mode reads. Per-tensor dynamic scales (one amax over all of x) are
the static path with the scale computed first. Values are clamped to +-448 and rounded to
nearest. Reference: kernels/reference.py ref_quant_fp8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.reference import FP8_MAX, FP8_MIN_SCALE
from batchrun.kernels.utils import FLOAT_DTYPES, check


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, GROUP, stride_x, stride_q, stride_s,
                      FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, STATIC: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * GROUP
    hi = tl.minimum(lo + GROUP, K)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < hi, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row * stride_s + g, scale)
    for k0 in range(lo, hi, BLOCK):
        mask = k0 + offs < hi
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quant_fp8(x: Tensor, group: int | None = None, scale: Tensor | None = None,
              per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    # x: [M, K] fp16/bf16/fp32 with contiguous rows -> (x_q [M, K] e4m3, scales fp32):
    # group None -> per row [M, 1]; group g -> per row and g columns [M, ceil(K/g)];
    # scale (static, [1]) or per_tensor (one dynamic scale) -> that scale in every row of [M, 1]
    check(x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.stride(1) == 1,
          f"quant_fp8 needs x [M, K] float with contiguous rows, got {tuple(x.shape)} {x.dtype}")
    check(not (group is not None and (scale is not None or per_tensor)),
          "quant_fp8: group scales are dynamic (no static or per-tensor scale with a group)")
    M, K = x.shape
    if per_tensor:
        scale = (x.abs().amax().float() / FP8_MAX).clamp(min=FP8_MIN_SCALE).reshape(1)
    groups = 1 if group is None else triton.cdiv(K, group)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, groups, dtype=torch.float32, device=x.device)
    if M == 0 or K == 0:
        return q, s
    width = K if group is None else group
    block = min(1024, triton.next_power_of_2(width))
    _quant_fp8_kernel[(M, groups)](
        x, q, s, s if scale is None else scale, K, width, x.stride(0), q.stride(0), s.stride(0),
        FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE, STATIC=scale is not None, BLOCK=block,
        num_warps=4)
    return q, s
