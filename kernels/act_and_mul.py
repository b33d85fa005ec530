"""act(gate) * up on the fused gate_up projection output, one kernel.

HF's gated MLP computes `act_fn(gate_proj(x)) * up_proj(x)`: the activation in the input dtype
(fp32 math, rounded once), then the multiply in the input dtype. The kernel does the same: the
activation in fp32, round to the input dtype, multiply in fp32 (exact for two bf16/fp16 values)
and round once. Grid from static shapes: CUDA-graph capturable.

`activation` (a constexpr, so each one compiles to its own kernel and "silu" to exactly the
SiLU code) is one of ACTIVATIONS:
  "silu"       F.silu: g * sigmoid(g) (Llama, Qwen2, Mistral)
  "gelu_tanh"  F.gelu(approximate="tanh"), HF's gelu_pytorch_tanh (Gemma 2/3):
               0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g^3))), computed as
               g * sigmoid(2 * inner) = g / (1 + exp(-2 * inner)), the same value, since
               0.5 * (1 + tanh(y)) = sigmoid(2y). Only tl.exp is needed (triton.language has no
               tanh; libdevice's is backend-specific), and there is no cancellation where
               tanh nears -1 (torch's fp32 form loses relative precision there; the two
               differ by about an fp32 ulp of |g|).

With `lora` (the LoRA delta of the gate_up projection, slices gate and up; see
kernels/lora_delta.py) a second kernel runs instead, on tiles of token rows x columns: gate and
up are first made rnd(gate + delta) and rnd(up + delta), the values a separate LoRA expand would
have written, so a LoRA step launches nothing extra. The no-LoRA kernel is the plain one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_delta import (delta_args, gather_consts, lora_delta_rows,
                                        lora_delta_tile, row_block, tile_shrunk, tile_slots)
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.pdl import pdl_enter, pdl_kwargs
from batchrun.kernels.utils import FLOAT_DTYPES, check


ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _act_mul(g, u, out_dtype, ACTIVATION: tl.constexpr):
    # g, u in the input dtype -> act(g) rounded to it, times u, rounded once to out_dtype
    gf = g.to(tl.float32)
    if ACTIVATION == "gelu_tanh":
        # torch's op order for the inner term: beta * (g + kappa * g^3), beta = sqrt(2 / pi)
        inner = 0.7978845608028654 * (gf + 0.044715 * (gf * gf * gf))
        a = gf / (1.0 + tl.exp(-2.0 * inner))       # F.gelu(tanh) (see the module docstring)
    else:
        a = gf / (1.0 + tl.exp(-gf))                 # F.silu
    s = a.to(g.dtype).to(tl.float32)                 # rounded to the input dtype, as HF's act_fn
    return (s * u.to(tl.float32)).to(out_dtype)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,            # [T, 2*I]  gate = [:, :I], up = [:, I:]
    out_ptr,          # [T, I]
    I,
    stride_x, stride_o,   # row strides (last dim contiguous)
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g_ptrs = x_ptr + row * stride_x + offs
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    u = tl.load(g_ptrs + I, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs,
             _act_mul(g, u, out_ptr.dtype.element_ty, ACTIVATION), mask=mask)


@triton.jit
def _act_and_mul_lora_kernel(
    x_ptr, out_ptr, T, I, stride_x, stride_o,        # as above, T rows
    s_ptr, stride_s, b_ptr, slot_ptr, LN, LS, LR,   # LoRA delta of x (gate | up slices)
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr, GATHER: tl.constexpr, R_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    # Grid (row tiles, column tiles): each program reads B[gate cols] and B[up cols] once per
    # slot of its rows' range, in one slot loop (GATHER: each row's own, all at once).
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < T, cols < I
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    g_ptrs = x_ptr + rows64[:, None] * stride_x + cols[None, :]
    g = tl.load(g_ptrs, mask=mask, other=0.0)
    u = tl.load(g_ptrs + I, mask=mask, other=0.0)
    slot, lo, hi = tile_slots(slot_ptr, rows, row_mask)
    if GATHER:
        dg, du = lora_delta_rows(s_ptr, stride_s, b_ptr, rows, slot, 0, 1, cols, cols + I,
                                 col_mask, LN, LS, LR, BLOCK_M, BLOCK_N, BLOCK_R, R_CHUNK, PAIR=True)
    else:
        sg = tile_shrunk(s_ptr, stride_s, rows, slot, 0, LS, LR, BLOCK_R, DOT_IEEE)
        su = tile_shrunk(s_ptr, stride_s, rows, slot, 1, LS, LR, BLOCK_R, DOT_IEEE)
        dg, du = lora_delta_tile(sg, su, b_ptr, slot, lo, hi, cols, cols + I, col_mask, LN, LR,
                                 BLOCK_M, BLOCK_N, BLOCK_R, DOT_IEEE, PAIR=True)
    g = (g.to(tl.float32) + dg).to(g.dtype)
    u = (u.to(tl.float32) + du).to(g.dtype)
    tl.store(out_ptr + rows64[:, None] * stride_o + cols[None, :],
             _act_mul(g, u, out_ptr.dtype.element_ty, ACTIVATION), mask=mask)


def act_and_mul(gate_up: Tensor, activation: str = "silu", out: Tensor | None = None,
                lora: LoRADelta | None = None) -> Tensor:
    # gate_up: [T, 2*I] -> out [T, I] (gate_up's dtype): activation(gate) * up, activation one
    # of ACTIVATIONS; lora: the delta of gate_up's two slices (gate_up itself is not written)
    check(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
          f"gate_up must be [T, 2*I], got {tuple(gate_up.shape)}")
    check(gate_up.dtype in FLOAT_DTYPES, f"unsupported dtype {gate_up.dtype}")
    check(gate_up.stride(1) == 1, "gate_up rows must be contiguous")
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    check(out.shape == (T, I) and out.dtype == gate_up.dtype and out.stride(1) == 1,
          f"out must be [{T}, {I}] {gate_up.dtype} with contiguous rows")
    if lora is not None:
        largs, consts = delta_args(lora, T, 2 * I, 2, gate_up.device)
    if T == 0 or I == 0:
        return out
    if lora is None:
        block = min(1024, triton.next_power_of_2(I))
        _act_and_mul_kernel[(T, triton.cdiv(I, block))](
            gate_up, out, I, gate_up.stride(0), out.stride(0), ACTIVATION=activation,
            BLOCK=block, num_warps=4, **pdl_kwargs(gate_up))
        return out
    # 64 columns: enough programs to fill the GPU at a few row tiles, and a [64, R] B tile
    # per slice and slot.
    bm, bn = row_block(T), min(64, max(16, triton.next_power_of_2(I)))
    _act_and_mul_lora_kernel[(triton.cdiv(T, bm), triton.cdiv(I, bn))](
        gate_up, out, T, I, gate_up.stride(0), out.stride(0), *largs, ACTIVATION=activation,
        BLOCK_M=bm, BLOCK_N=bn, **consts, **gather_consts(T, bm, bn, consts["BLOCK_R"], pairs=2),
        num_warps=4, num_stages=1, **pdl_kwargs(gate_up))
    return out
