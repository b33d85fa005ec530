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

With `lora` (a LoRADelta for the projection that produced x, see kernels/lora_delta.py) the
rows are normalised after x = rnd(x + delta), exactly the x a separate LoRA expand would have
written (and after the residual add). A LoRA step thus runs no separate expand for o_proj /
down_proj; the no-LoRA path is the one plain launch, untouched. Two forms:

- small steps (GATHER steps, at most lora_delta.GATHER_MAX_ROWS rows: latency decode) run ONE
  launch over rows x 128-column chunks: each program adds its chunk's delta (its row's slot's B
  columns) and residual and leaves the chunk's sum of squares; the row's last program (an
  atomic ticket) normalises the row. At 8 rows the separate delta kernel was a launch of its
  own (~2 us) for little work. (One program per whole row, gathering 128 KB of B alone, was
  slower still: 7.3 us against 3.9 us for two launches on the H200.)
- larger steps run two: a delta kernel over 16-32-row x CHUNK tiles (B read once per tile and
  slot) that writes rnd(x + delta) (+ residual) to `residual` or a staging tensor, then the
  plain kernel over the result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_delta import (delta_args, gather_consts, lora_delta_rows,
                                        lora_delta_tile, row_block, tile_shrunk, tile_slots)
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.utils import FLOAT_DTYPES, check

DELTA_CHUNKS = 32  # column chunks per row of the LoRA delta kernel (at least 128 columns each)
# Small (GATHER) LoRA steps normalise in one launch (_add_lora_delta_norm_kernel). Read at launch
# time, so a benchmark can set it False to time the two-launch form at the same rows.
ONE_LAUNCH_SMALL = True


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
def _add_lora_delta_kernel(
    x_ptr, res_ptr, h_ptr,   # h = rnd(x + delta) goes to h_ptr, or (FUSED_ADD) rnd(res + h) to res
    T, H,
    stride_x, stride_r, stride_h,
    s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR,   # the LoRA delta of x
    FUSED_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr, GATHER: tl.constexpr, R_CHUNK: tl.constexpr,
):
    # Grid (row tiles, column chunks), every program independent: B is read once per tile and
    # slot of its rows' range, and the tile's delta is one tensor-core dot per slot.
    tile = tl.program_id(0)
    c = tl.program_id(1)
    xdt = x_ptr.dtype.element_ty
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    col_mask = offs < H
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
    slot, lo, hi = tile_slots(slot_ptr, rows, row_mask)
    if GATHER:
        d, _ = lora_delta_rows(s_ptr, stride_s, b_ptr, rows, slot, 0, 0, offs, offs, col_mask,
                               LN, LL, LR, BLOCK_M, CHUNK, BLOCK_R, R_CHUNK, PAIR=False)
    else:
        s = tile_shrunk(s_ptr, stride_s, rows, slot, 0, LL, LR, BLOCK_R, DOT_IEEE)
        d, _ = lora_delta_tile(s, s, b_ptr, slot, lo, hi, offs, offs, col_mask, LN, LR,
                               BLOCK_M, CHUNK, BLOCK_R, DOT_IEEE, PAIR=False)
    h = (x.to(tl.float32) + d).to(xdt)                    # the x a separate expand would leave
    if FUSED_ADD:
        r_ptrs = res_ptr + rows64[:, None] * stride_r + offs[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        tl.store(r_ptrs, (r.to(tl.float32) + h.to(tl.float32)).to(xdt), mask=mask)
    else:
        tl.store(h_ptr + rows64[:, None] * stride_h + offs[None, :], h, mask=mask)


@triton.jit
def _add_lora_delta_norm_kernel(
    x_ptr, res_ptr, h_ptr, w_ptr, out_ptr,   # h = rnd(x + delta) to h_ptr, or FUSED_ADD: to res
    part_ptr, ticket_ptr,    # fp32 [>= T, NUM_CHUNKS] partial sums of squares; int32 [>= T], 0
    H, eps,
    stride_x, stride_r, stride_h, stride_o,
    s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR,   # the LoRA delta of x (one slice)
    FUSED_ADD: tl.constexpr,
    CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,   # NUM_CHUNKS: next power of 2 >= cdiv(H, CHUNK)
    BLOCK_R: tl.constexpr,
):
    # Grid (rows, column chunks). Each program adds its chunk's delta (its row's slot's B
    # columns, [CHUNK, R]) and residual, stores h, and leaves the chunk's sum of squares in
    # part_ptr; the last program of a row (a ticket counter) sums the row's partials in chunk
    # order (deterministic), normalises the row's h and resets the ticket for the next launch.
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    num_c = tl.cdiv(H, CHUNK)
    xdt = x_ptr.dtype.element_ty
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    slot = tl.load(slot_ptr + row)
    d = tl.zeros((CHUNK,), dtype=tl.float32)
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        s = tl.load(s_ptr + row * stride_s + slot.to(tl.int64) * LR + offs_r,   # slice 0
                    mask=offs_r < LR, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + slot.to(tl.int64) * LN * LR + offs.to(tl.int64)[:, None] * LR
                    + offs_r[None, :], mask=mask[:, None] & (offs_r < LR)[None, :], other=0.0)
        d = tl.sum(b.to(tl.float32) * s[None, :], axis=1)
    h = (x.to(tl.float32) + d).to(xdt)                    # the x a separate expand would leave
    if FUSED_ADD:
        h_row = res_ptr + row * stride_r
        r = tl.load(h_row + offs, mask=mask, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(xdt)
    else:
        h_row = h_ptr + row * stride_h
    tl.store(h_row + offs, h, mask=mask)
    hf = h.to(tl.float32)
    tl.store(part_ptr + row * NUM_CHUNKS + c, tl.sum(hf * hf, axis=0))
    # Every thread's stores happen before the ticket (barrier), and acq_rel makes them visible
    # to the row's last program, which reads them from L2 (.cg).
    tl.debug_barrier()
    if tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel") == num_c - 1:
        offs_p = tl.arange(0, NUM_CHUNKS)
        parts = tl.load(part_ptr + row * NUM_CHUNKS + offs_p, mask=offs_p < num_c, other=0.0,
                        cache_modifier=".cg")
        rstd = tl.math.rsqrt(tl.sum(parts, axis=0) / H + eps)
        for c2 in range(0, num_c):
            o2 = c2 * CHUNK + tl.arange(0, CHUNK)
            m2 = o2 < H
            hh = tl.load(h_row + o2, mask=m2, other=0.0, cache_modifier=".cg").to(tl.float32)
            n = (hh * rstd).to(xdt).to(tl.float32)             # HF: cast before the weight
            w = tl.load(w_ptr + o2, mask=m2, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * stride_o + o2, (w * n).to(out_ptr.dtype.element_ty), mask=m2)
        tl.atomic_xchg(ticket_ptr + row, 0)


_SCRATCH: dict = {}  # device -> (partials fp32 [rows, chunks], tickets int32 [rows], all 0)


def _scratch(device, rows: int, chunks: int) -> tuple[Tensor, Tensor]:
    """The one-launch norm's partial sums and row tickets on `device`: allocated once (grown
    outside graph capture only), left zeroed by every launch, so captured graphs can share them.
    Launches on one stream run one after another; one scratch per device suffices."""
    have = _SCRATCH.get(device)
    if have is None or have[0].shape[0] < rows or have[0].shape[1] < chunks:
        check(not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()),
              f"the LoRA norm scratch must exist before graph capture ({rows} rows x {chunks} "
              f"chunks): run the step once eagerly first")
        r, c = max(rows, 256, have[0].shape[0] if have else 0), max(chunks, 64)
        have = (torch.zeros(r, c, dtype=torch.float32, device=device),
                torch.zeros(r, dtype=torch.int32, device=device))
        _SCRATCH[device] = have
    return have


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
    if lora is not None:
        largs, consts = delta_args(lora, T, H, 1, x.device)
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
    bm = row_block(T)
    chunk = max(128, triton.next_power_of_2(triton.cdiv(H, DELTA_CHUNKS)))
    form = gather_consts(T, bm, chunk, consts["BLOCK_R"])
    if residual is not None:
        h = residual                                            # becomes res + rnd(x + delta)
    elif out.dtype == x.dtype:
        h = out                                                 # staged; normalised in place
    else:
        h = torch.empty((T, H), dtype=x.dtype, device=x.device)  # n rounds to x's dtype (HF)
    if form["GATHER"] and ONE_LAUNCH_SMALL:
        # Small step: one launch, rows x 128-column chunks, the row's norm in its last program.
        chunk = 128
        num_chunks = triton.next_power_of_2(triton.cdiv(H, chunk))
        parts, tickets = _scratch(x.device, T, num_chunks)
        _add_lora_delta_norm_kernel[(T, triton.cdiv(H, chunk))](
            x, res, h, weight, out, parts, tickets, H, eps,
            x.stride(0), res.stride(0), h.stride(0), out.stride(0), *largs,
            FUSED_ADD=residual is not None, CHUNK=chunk, NUM_CHUNKS=parts.shape[1],
            BLOCK_R=consts["BLOCK_R"], num_warps=4, num_stages=1)
        return out
    # Larger steps, two launches: the delta (and residual add) on 16-32-row x CHUNK tiles, in
    # parallel over the whole [T, H], then the plain row norm of the result. The ticket form
    # with tiles (each tile's last program normalising its 16 rows) serialised H columns x 16
    # rows in one program: 20 µs a norm at 256 rows on the H200, against ~3 µs plain.
    _add_lora_delta_kernel[(triton.cdiv(T, bm), triton.cdiv(H, chunk))](
        x, res, h, T, H, x.stride(0), res.stride(0), h.stride(0), *largs,
        FUSED_ADD=residual is not None, BLOCK_M=bm, CHUNK=chunk, **consts, **form,
        num_warps=4, num_stages=1)
    _rms_norm_kernel[(T,)](
        h, h, weight, out, H, eps, h.stride(0), h.stride(0), out.stride(0),
        FUSED_ADD=False, BLOCK_N=block, num_warps=num_warps)
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
