"""RMSNorm and fused residual-add + RMSNorm, one program per row (vLLM's fused_add_rms_norm).

Math follows HF's LlamaRMSNorm op for op (see ref_rms_norm / ref_fused_add_rms_norm):
  h = x + residual                     rounded to the model dtype (HF adds in the model dtype)
  n = (h.float() * rsqrt(mean(h.float()^2) + eps)).to(dtype)
  y = weight * n                       product of two model-dtype values, rounded once
Products and sums of two bf16/fp16 values are exact in fp32, so doing them in fp32 and
rounding once gives torch's bf16/fp16 result. Only the sum-of-squares order differs.

The fused op updates `residual` in place (it becomes h) and writes the normed rows to a new
tensor. A row is loaded whole (BLOCK_N = next power of two >= H, masked), so any hidden size
works. Static grid (T,), no host syncs: CUDA-graph capturable.

With `lora` (a LoRADelta for the projection that produced x, see kernels/lora_delta.py) a
second kernel first makes x = rnd(x + delta), exactly the x a separate LoRA expand would have
written, and then goes on as above: a LoRA decode step pays no extra launch for o_proj /
down_proj. It splits each row over NUM_CHUNKS programs (see _rms_norm_lora_kernel) and needs
the delta's zeroed counters; the no-LoRA kernel is untouched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_delta import delta_args, lora_delta, r_chunk
from batchrun.kernels.lora_meta import MAX_NORM_CHUNKS, LoRADelta
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
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if FUSED_ADD:
        r_ptrs = res_ptr + row * stride_r + offs
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)    # add in the model dtype
        tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    rstd = tl.math.rsqrt(var + eps)
    n = (xf * rstd).to(x.dtype).to(tl.float32)                   # HF: cast before the weight
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * n).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_lora_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,   # as in _rms_norm_kernel
    part_ptr,         # fp32 [T, NUM_CHUNKS]  sum of squares of each chunk of h
    cnt_ptr,          # int32 [T]  chunks of the row done; 0 before and after the launch
    H, eps,
    stride_x, stride_r, stride_o,
    s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR,   # the LoRA delta of x
    FUSED_ADD: tl.constexpr,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr,
):
    # Grid (T, NUM_CHUNKS): the delta needs a [H, R] slice of B per row, too much for one
    # program per row (a decode step has ~8 rows), so each program adds the delta to one chunk,
    # writes h = rnd(x + delta) (+ residual) and its chunk's sum of squares; the row's last
    # program to finish (an atomic ticket) sums the partials in chunk order (deterministic)
    # and normalises the whole row.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    xdt = x_ptr.dtype.element_ty
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    d = lora_delta(s_ptr, stride_s, b_ptr, slot_ptr, row, 0, offs[None, :], mask[None, :],
                   LN, LL, LR, BLOCK_R, R_CHUNK)
    h = (x.to(tl.float32) + tl.sum(d, axis=0)).to(xdt)
    if FUSED_ADD:
        h_row = res_ptr + row * stride_r
        r = tl.load(h_row + offs, mask=mask, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(xdt)
    else:
        h_row = out_ptr + row * stride_o  # staging: the last program normalises it in place
    tl.store(h_row + offs, h, mask=mask)
    hf = h.to(tl.float32)
    tl.store(part_ptr + row * NUM_CHUNKS + c, tl.sum(hf * hf, axis=0))
    tl.debug_barrier()  # all of this program's stores come before its release below
    ticket = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if ticket == NUM_CHUNKS - 1:
        tl.debug_barrier()
        oc = tl.arange(0, BLOCK_C)
        parts = tl.load(part_ptr + row * NUM_CHUNKS + oc, mask=oc < NUM_CHUNKS, other=0.0,
                        cache_modifier=".cg")
        rstd = tl.math.rsqrt(tl.sum(parts, axis=0) / H + eps)
        on = tl.arange(0, BLOCK_N)
        nm = on < H
        hr = tl.load(h_row + on, mask=nm, other=0.0, cache_modifier=".cg").to(tl.float32)
        n = (hr * rstd).to(xdt).to(tl.float32)                    # HF: cast before the weight
        w = tl.load(w_ptr + on, mask=nm, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + on, (w * n).to(out_ptr.dtype.element_ty), mask=nm)
        tl.store(cnt_ptr + row, 0)  # ready for the next launch


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
            out: Tensor | None, lora: LoRADelta | None) -> Tensor:
    check(x.dim() == 2, f"x must be [T, H], got {tuple(x.shape)}")
    T, H = x.shape
    check(x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES, "unsupported dtype")
    check(weight.shape == (H,) and weight.is_contiguous(), f"weight must be contiguous [{H}]")
    check(x.stride(1) == 1, "x rows must be contiguous")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)       # torch's `weight * n` dtype
    if out is None:
        out = torch.empty((T, H), dtype=out_dtype, device=x.device)
    check(out.shape == (T, H) and out.stride(1) == 1 and out.dtype == out_dtype,
          f"out must be [{T}, {H}] {out_dtype} with contiguous rows")
    if residual is not None:
        check(residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1,
              "residual must match x (shape, dtype) with contiguous rows")
        check(residual.data_ptr() != out.data_ptr(), "out must not alias residual")
    if T == 0:
        return out
    block = triton.next_power_of_2(H)
    num_warps = 4 if block <= 1024 else (8 if block <= 4096 else 16)
    res = residual if residual is not None else x
    if lora is None:
        _rms_norm_kernel[(T,)](
            x, res, weight, out, H, eps, x.stride(0), res.stride(0), out.stride(0),
            FUSED_ADD=residual is not None, BLOCK_N=block, num_warps=num_warps)
        return out
    largs, block_r = delta_args(lora, x, T, H, 1)
    chunk = max(128, triton.next_power_of_2(triton.cdiv(H, MAX_NORM_CHUNKS)))
    n_chunks = triton.cdiv(H, chunk)
    parts, counters = lora.norm_scratch(T, n_chunks)
    _rms_norm_lora_kernel[(T, n_chunks)](
        x, res, weight, out, parts, counters, H, eps, x.stride(0), res.stride(0), out.stride(0),
        *largs, FUSED_ADD=residual is not None, CHUNK=chunk, NUM_CHUNKS=n_chunks,
        BLOCK_C=triton.next_power_of_2(n_chunks), BLOCK_N=block, BLOCK_R=block_r,
        R_CHUNK=r_chunk(block_r, chunk), num_warps=4)
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None,
             lora: LoRADelta | None = None) -> Tensor:
    # x: [T, H], weight: [H] -> normed [T, H] (new tensor unless `out` is given); with `lora`,
    # normed rnd(x + delta) (x itself is not written).
    return _launch(x, None, weight, eps, out, lora)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       out: Tensor | None = None,
                       lora: LoRADelta | None = None) -> tuple[Tensor, Tensor]:
    # x, residual: [T, H], weight: [H] -> (normed [T, H], residual). `residual` is updated in
    # place to x + residual (model dtype) and returned; normed goes to a new tensor / `out`.
    # With `lora`, x + delta (rounded) takes x's place.
    return _launch(x, residual, weight, eps, out, lora), residual
