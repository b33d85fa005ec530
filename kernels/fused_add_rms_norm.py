"""RMSNorm and fused residual-add + RMSNorm, one program per row (vLLM's fused_add_rms_norm).

Math follows HF's LlamaRMSNorm op for op (see ref_rms_norm / ref_fused_add_rms_norm):
  h = x + residual                     rounded to the model dtype (HF adds in the model dtype)
  n = (h.float() * rsqrt(mean(h.float()^2) + eps)).to(dtype)
  y = weight * n                       product of two model-dtype values, rounded once
Products and sums of two bf16/fp16 values are exact in fp32, so doing them in fp32 and
rounding once gives torch's bf16/fp16 result. Only the sum-of-squares order differs.

With `offset` != 0 (1.0 for Gemma 2/3, whose checkpoints store the scale minus one) the norm is
HF's GemmaRMSNorm instead: the scale is offset + weight in fp32 and the cast comes last,
  y = (h.float() * rsqrt(mean(h.float()^2) + eps) * (offset + weight.float())).to(h.dtype)
so y has x's dtype whatever the weight's. `offset` is a constexpr: offset 0 compiles to the
Llama code alone.

The fused op updates `residual` in place (it becomes h) and writes the normed rows to a new
tensor; with `shrink=` and no `lora`, h goes to a new residual tensor instead (that launch runs
several programs per row, which in place would race), and the caller takes the returned one.
A row is loaded whole (BLOCK_N = next power of two >= H, masked), so any hidden size works.
Static grid (T,), no host syncs: CUDA-graph capturable.

rms_norm also takes x of shape [T, Hh, D] (a per-head q/k norm over D, Gemma 3): one program per
(row, head), reading x through its strides, so a head view of the fused qkv output needs no copy.
That form takes no residual, LoRA delta or shrink.

With `lora` (a LoRADelta for the projection that produced x, see kernels/lora_delta.py) a
delta kernel first makes x = rnd(x + delta), exactly the x a separate LoRA expand would have
written, and adds the residual (written to `residual`, or staged in `out`); the plain kernel
then normalises those rows. A LoRA step thus runs no separate expand for o_proj / down_proj;
the no-LoRA path is the one plain launch, untouched.

With `shrink` (a LoRAShrink, kernels/rms_norm_shrink.py) the norm launch is the one that also
computes the next projection's LoRA shrink x . A of each row's slot: a fused LoRA decode step
then streams only W in gate_up's fused GEMM + SiLU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.add_lora_delta import launch_delta
from batchrun.kernels.lora_delta import delta_args
from batchrun.kernels.lora_meta import LoRADelta, LoRAShrink
from batchrun.kernels.pdl import pdl_enter, pdl_kwargs
from batchrun.kernels.utils import FLOAT_DTYPES, check


@triton.jit
def _rms_norm_kernel(
    x_ptr,            # [T, H]   input rows (the sublayer output when FUSED_ADD)
    res_ptr,          # [T, H]   residual, updated in place to x + residual (FUSED_ADD only)
    w_ptr,            # [H]
    out_ptr,          # [T, H]   normed rows
    H, eps,
    stride_x, stride_r, stride_o,   # row strides (last dim contiguous)
    FUSED_ADD: tl.constexpr,
    OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if FUSED_ADD:
        r_ptrs = res_ptr + row * stride_r + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)    # add in the model dtype
        tl.store(r_ptrs, x, mask=mask)
    tl.store(out_ptr + row * stride_o + offs,
             norm_row(x, w_ptr, offs, mask, H, eps, out_ptr, OFFSET), mask=mask)


@triton.jit
def _rms_norm_heads_kernel(
    x_ptr,            # [T, Hh, D]  any strides, last dim contiguous
    w_ptr,            # [D]
    out_ptr,          # [T, Hh, D]  normed heads
    D, eps,
    stride_xt, stride_xh, stride_ot, stride_oh,
    OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < D
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs,
             norm_row(x, w_ptr, offs, mask, D, eps, out_ptr, OFFSET), mask=mask)


@triton.jit
def norm_row(x, w_ptr, offs, mask, H, eps, out_ptr, OFFSET: tl.constexpr):
    # one row x [BLOCK_N] (model dtype, masked lanes 0) -> the normed row in out_ptr's dtype:
    # weight * n (OFFSET 0, Llama) or n * (OFFSET + weight) in fp32 (Gemma)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    rstd = tl.math.rsqrt(var + eps)
    if OFFSET == 0.0:
        n = (xf * rstd).to(x.dtype).to(tl.float32)               # HF: cast before the weight
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (w * n).to(out_ptr.dtype.element_ty)
    else:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = ((xf * rstd) * (OFFSET + w)).to(out_ptr.dtype.element_ty)   # cast last (Gemma)
    return y


def _out_dtype(x: Tensor, weight: Tensor, offset: float) -> torch.dtype:
    # torch's `weight * n` dtype (Llama), or x's (Gemma's `.type_as(x)`)
    return torch.promote_types(x.dtype, weight.dtype) if offset == 0.0 else x.dtype


def _launch_heads(x: Tensor, weight: Tensor, eps: float, out: Tensor | None,
                  offset: float) -> Tensor:
    # x [T, Hh, D] -> each head normed over D
    T, Hh, D = x.shape
    check(x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES, "unsupported dtype")
    check(weight.shape == (D,) and weight.is_contiguous(), f"weight must be contiguous [{D}]")
    check(x.stride(2) == 1, "x heads must be contiguous")
    out_dtype = _out_dtype(x, weight, offset)
    if out is None:
        out = torch.empty((T, Hh, D), dtype=out_dtype, device=x.device)
    check(out.shape == (T, Hh, D) and out.stride(2) == 1 and out.dtype == out_dtype,
          f"out must be [{T}, {Hh}, {D}] {out_dtype} with contiguous heads")
    if T == 0 or Hh == 0:
        return out
    block = triton.next_power_of_2(D)
    _rms_norm_heads_kernel[(T, Hh)](
        x, weight, out, D, eps, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        OFFSET=offset, BLOCK_N=block, num_warps=1 if block <= 256 else 4, **pdl_kwargs(x))
    return out


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
            out: Tensor | None, lora: LoRADelta | None,
            shrink: LoRAShrink | None, offset: float) -> tuple[Tensor, Tensor | None]:
    # -> (normed rows, the updated residual: `residual` itself, or a new tensor on the
    # residual add + shrink launch)
    check(x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}")
    T, H = x.shape
    check(x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES, "unsupported dtype")
    check(weight.shape == (H,) and weight.is_contiguous(), f"weight must be contiguous [{H}]")
    check(x.stride(1) == 1, "x rows must be contiguous")
    out_dtype = _out_dtype(x, weight, offset)
    if out is None:
        out = torch.empty((T, H), dtype=out_dtype, device=x.device)
    check(out.shape == (T, H) and out.stride(1) == 1 and out.dtype == out_dtype,
          f"out must be [{T}, {H}] {out_dtype} with contiguous rows")
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1,
              "residual must match x (shape, dtype) with contiguous rows")
        check(residual.data_ptr() != out.data_ptr(), "out must not alias residual")
    if lora is not None:
        largs, consts = delta_args(lora, T, H, 1, x.device)
    if shrink is not None:  # before any launch: the delta kernel updates the residual in place
        shrink.validate(T, H, out_dtype, x.device)
    if T == 0:
        return out, residual
    block = triton.next_power_of_2(H)
    num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    res = residual if residual is not None else x
    if shrink is not None:
        from batchrun.kernels.rms_norm_shrink import norm_and_shrink
    if lora is None and shrink is not None:
        # several programs per row: the sum goes to a new residual (in place they would race)
        res_out = None if residual is None else torch.empty((T, H), dtype=x.dtype, device=x.device)
        norm_and_shrink(x, residual, weight, eps, out, shrink, num_warps, res_out, offset)
        return out, res_out
    if lora is None:
        _rms_norm_kernel[(T,)](
            x, res, weight, out, H, eps, x.stride(0), res.stride(0), out.stride(0),
            FUSED_ADD=residual is not None, OFFSET=offset, BLOCK_N=block, num_warps=num_warps,
            **pdl_kwargs(x))
        return out, residual
    # Two launches: the delta (and residual add) on 16-32-row x CHUNK tiles, in parallel over the
    # whole [T, H], then the plain row norm of the result. A single launch serialises work: the
    # last program of a tile (an atomic ticket) normalises H columns x 16 rows alone, or one
    # program per row gathers its slot's whole B; both measured slower than these two launches
    # (docs/benchmarks.md's decision log).
    if residual is not None:
        h = residual                                            # becomes res + rnd(x + delta)
    elif out.dtype == x.dtype and shrink is None:
        h = out      # staged; normalised in place (not with shrink: a row's programs would race)
    else:
        h = torch.empty((T, H), dtype=x.dtype, device=x.device)  # n rounds to x's dtype (HF)
    launch_delta(x, res, h, largs, consts, fused_add=residual is not None)
    if shrink is not None:
        norm_and_shrink(h, None, weight, eps, out, shrink, num_warps, offset=offset)
        return out, residual
    _rms_norm_kernel[(T,)](
        h, h, weight, out, H, eps, h.stride(0), h.stride(0), out.stride(0),
        FUSED_ADD=False, OFFSET=offset, BLOCK_N=block, num_warps=num_warps, **pdl_kwargs(x))
    return out, residual


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None,
             lora: LoRADelta | None = None, shrink: LoRAShrink | None = None,
             offset: float = 0.0) -> Tensor:
    # x: [T, H], weight: [H] -> normed [T, H] (new tensor unless `out` is given); with `lora`,
    # normed rnd(x + delta) (x itself is not written); with `shrink`, also the next
    # projection's LoRA shrink of the normed rows into shrink.out (kernels/rms_norm_shrink.py).
    # offset: 0 for Llama's norm, 1 for Gemma's (scale offset + weight, see the docstring).
    # x: [T, Hh, D] (any strides, heads contiguous), weight: [D] -> each head normed over D,
    # [T, Hh, D]; no lora or shrink.
    offset = float(offset)
    if x.dim() == 3:
        check(lora is None and shrink is None, "a per-head norm takes no LoRA delta or shrink")
        return _launch_heads(x, weight, eps, out, offset)
    return _launch(x, None, weight, eps, out, lora, shrink, offset)[0]


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       out: Tensor | None = None, lora: LoRADelta | None = None,
                       shrink: LoRAShrink | None = None,
                       offset: float = 0.0) -> tuple[Tensor, Tensor]:
    # x, residual: [T, H], weight: [H] -> (normed [T, H], x + residual). The sum (model dtype)
    # is written into `residual` in place and returned, except with `shrink` and no `lora`:
    # then it goes to a new tensor (returned; `residual` is left as it was), since that
    # launch has several programs per row. Normed rows go to a new tensor / `out`.
    # With `lora`, x + delta (rounded) takes x's place; with `shrink`, as rms_norm; offset as
    # rms_norm.
    return _launch(x, residual, weight, eps, out, lora, shrink, float(offset))
