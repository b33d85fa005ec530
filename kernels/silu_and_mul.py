"""SiLU(gate) * up on the fused gate_up projection output, one kernel.

HF's MLP computes `act_fn(gate_proj(x)) * up_proj(x)`: F.silu in the input dtype (fp32 math,
rounded once), then the multiply in the input dtype. The kernel does the same: silu in fp32,
round to the input dtype, multiply in fp32 (exact for two bf16/fp16 values) and round once.
Grid (T, cdiv(I, BLOCK)) from static shapes: CUDA-graph capturable.

With `lora` (the LoRA delta of the gate_up projection, slices gate and up; see
kernels/lora_delta.py) gate and up are first made rnd(gate + delta) and rnd(up + delta), the
values a separate LoRA expand would have written, so a LoRA decode step launches nothing extra.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_delta import delta_args, lora_delta, r_chunk
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.utils import FLOAT_DTYPES, check


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,            # [T, 2*I]  gate = [:, :I], up = [:, I:]
    out_ptr,          # [T, I]
    I,
    stride_x, stride_o,   # row strides (last dim contiguous)
    s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR,   # LoRA delta of x (HAS_LORA only)
    BLOCK: tl.constexpr,
    HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g_ptrs = x_ptr + row * stride_x + offs
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    u = tl.load(g_ptrs + I, mask=mask, other=0.0)
    if HAS_LORA:
        cols, m2 = offs[None, :], mask[None, :]
        dg = lora_delta(s_ptr, stride_s, b_ptr, slot_ptr, row, 0, cols, m2, LN, LL, LR,
                        BLOCK_R, R_CHUNK)
        du = lora_delta(s_ptr, stride_s, b_ptr, slot_ptr, row, 1, cols + I, m2, LN, LL, LR,
                        BLOCK_R, R_CHUNK)
        g = (g.to(tl.float32) + tl.sum(dg, axis=0)).to(g.dtype)
        u = (u.to(tl.float32) + tl.sum(du, axis=0)).to(g.dtype)
    u = u.to(tl.float32)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)   # F.silu in the input dtype
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: Tensor, out: Tensor | None = None,
                 lora: LoRADelta | None = None) -> Tensor:
    # gate_up: [T, 2*I] -> out [T, I] (gate_up's dtype); lora: the delta of gate_up's two
    # slices (gate_up itself is not written)
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
          f"gate_up must be [T, 2*I], got {tuple(gate_up.shape)}")
    check(gate_up.dtype in FLOAT_DTYPES, f"unsupported dtype {gate_up.dtype}")
    check(gate_up.stride(1) == 1, "gate_up rows must be contiguous")
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    check(out.shape == (T, I) and out.dtype == gate_up.dtype and out.stride(1) == 1,
          f"out must be [{T}, {I}] {gate_up.dtype} with contiguous rows")
    if T == 0 or I == 0:
        return out
    largs, block_r = delta_args(lora, gate_up, T, 2 * I, 2)
    # The LoRA variant loads [BLOCK, R] weights twice per program: smaller column blocks (more
    # programs) keep that in registers.
    block = min(1024 if lora is None else 128, triton.next_power_of_2(I))
    grid = (T, triton.cdiv(I, block))
    _silu_and_mul_kernel[grid](gate_up, out, I, gate_up.stride(0), out.stride(0), *largs,
                               BLOCK=block, HAS_LORA=lora is not None, BLOCK_R=block_r,
                               R_CHUNK=r_chunk(block_r, block), num_warps=4)
    return out
