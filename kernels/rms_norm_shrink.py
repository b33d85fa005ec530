"""RMSNorm that also computes the LoRA shrink of the projection after it, for each row's own
slot: `shrunk[t, (slot*S + s)*R + r] = rnd(n[t] . A[s, slot, r])`, where n is the normed row it
writes (kernels/lora_meta.py: LoRAShrink).

Why: on a LoRA decode step of a few rows, gate_up runs as the fused GEMM + SiLU-and-mul kernel
(kernels/skinny_gate_up_silu.py), which streams W only; the delta it adds before the SiLU needs
x . A first. A program here holds a whole normed row in registers, so the shrink costs only the
A rows' reads (S*R rows of K, from L2 after the first row of a slot), not a launch of its own.

Grid (T, chunks): every program of a row computes the row's norm (a row is a few KB) and
BLOCK_J of its S*R shrink values; the first one writes the normed row. With FUSED_ADD every
program adds the residual row to x and the first one writes the sum to a NEW residual tensor
(res_out): in place, a row's other programs could read the residual after it was overwritten.
Chunks, not one program per row: at 8 rows one program per row leaves the GPU nearly idle.
Rows with slot -1 write no shrink values.

The shrink sums the K products in fp32 (products of two 16-bit values are exact) and rounds once
to the model dtype, as the fused GEMM over [W; A] does; the order of the sum differs.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.fused_add_rms_norm import norm_row
from batchrun.kernels.lora_meta import LoRAShrink
from batchrun.kernels.pdl import pdl_enter, pdl_kwargs

BLOCK_J = 4  # shrink values per program (A rows read together)


@triton.jit
def _rms_norm_shrink_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,   # as kernels/fused_add_rms_norm.py's _rms_norm_kernel
    res_out_ptr, stride_ro,           # FUSED_ADD: x + residual goes here
    H, eps, stride_x, stride_r, stride_o,
    a_ptr, stride_as, stride_al, stride_ar,   # A [S, L, R, K] (last dim contiguous)
    slot_ptr, s_ptr, stride_s, R, SR,         # slots [>= T]; shrunk [T, k*S*R]; SR = S*R
    FUSED_ADD: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_J: tl.constexpr,                    # shrink values per program (A rows read together)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if FUSED_ADD:  # every program of the row adds; the first writes the new residual
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)    # add in the model dtype
    y = norm_row(x, w_ptr, offs, mask, H, eps, out_ptr, OFFSET)
    if c == 0:
        if FUSED_ADD:
            tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        yf = y.to(tl.float32)
        a_slot = a_ptr + slot.to(tl.int64) * stride_al
        j = c * BLOCK_J + tl.arange(0, BLOCK_J)  # this program's shrink values
        jm = j < SR
        a_rows = a_slot + (j // R).to(tl.int64) * stride_as + (j % R).to(tl.int64) * stride_ar
        a = tl.load(a_rows[:, None] + offs[None, :], mask=jm[:, None] & mask[None, :], other=0.0)
        acc = tl.sum(a.to(tl.float32) * yf[None, :], axis=1)
        tl.store(s_ptr + row * stride_s + slot * SR + j, acc.to(s_ptr.dtype.element_ty),
                 mask=jm)


def norm_and_shrink(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, out: Tensor,
                    shrink: LoRAShrink, num_warps: int, res_out: Tensor | None = None,
                    offset: float = 0.0) -> None:
    """The launch behind fused_add_rms_norm / rms_norm's `shrink=` (which check x, residual,
    weight, out and shrink, and skip T = 0): normed rows to `out`, x + residual to `res_out`
    (a [T, H] tensor with contiguous rows, not aliasing residual; needed with residual) and the
    shrink of each row's slot to `shrink.out`. offset: the norm's (kernels/fused_add_rms_norm.py);
    the shrink is of the normed rows either way."""
    T, H = x.shape
    S, _, R, _ = shrink.lora_a.shape
    sr = S * R
    res = residual if residual is not None else x
    if residual is not None:
        assert (res_out is not None and res_out.shape == x.shape and res_out.stride(1) == 1
                and res_out.data_ptr() != residual.data_ptr()), "res_out: a new [T, H] tensor"
    ro = res_out if res_out is not None else x
    a = shrink.lora_a
    _rms_norm_shrink_kernel[(T, triton.cdiv(sr, BLOCK_J))](
        x, res, weight, out, ro, ro.stride(0), H, eps, x.stride(0), res.stride(0), out.stride(0),
        a, a.stride(0), a.stride(1), a.stride(2),
        shrink.token_slots, shrink.out, shrink.out.stride(0), R, sr,
        FUSED_ADD=residual is not None, OFFSET=float(offset), BLOCK_N=triton.next_power_of_2(H),
        BLOCK_J=BLOCK_J,
        num_warps=num_warps, **pdl_kwargs(x))
