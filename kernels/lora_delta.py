"""LoRA delta over a tile of token rows x output columns: device functions that the elementwise
kernels after each projection (rotary, RMSNorm, SiLU-and-mul) call on a LoRA step, so the delta
costs no launch of its own.

Where the inputs come from (batchrun/lora/layer.py): a LoRA-able Linear keeps its weight and
the A matrices of every slot in one tensor [N + S*L*R, K], so on a LoRA step one base GEMM also
computes the shrink: columns N.. of its output hold `shrunk[t, (s*L + l)*R + r] = x[t] .
A[s, l, r]` for every slice s, slot l and rank r. The consumer then adds, for token t with slot
l = slot[t] >= 0 and output column n of slice s,

    delta[t, n] = sum_r shrunk[t, (s*L + l)*R + r] * B[l, n, r]        (fp32 accumulation)

with B stored [L, N, R] (fused output layout, scaling folded in). Tokens with slot -1 (no LoRA,
padding) get 0. The caller rounds `y + delta` once to the model dtype, which is what a separate
expand kernel writing y would have produced.

Why tiles: a program owns BLOCK_M rows x BLOCK_N columns and, for each slot l present among its
rows, does one tensor-core dot `where(slot == l, s_l, 0) [M, R] @ B_l[cols].T [R, N]`, so B is
read once per tile and slot instead of once per token row (at 256 rows the per-row form read
B 256 times a step). Rows need not be sorted by slot: rows of other slots (and slot -1) enter
the dot as zeros, so the masked sum is exact. Slots are walked over the tile's [min, max]
range, skipping the absent ones.

Precision: 16-bit s and B of the same dtype are dotted as they are (their products are exact in
fp32, accumulated in fp32); any other pair is dotted in fp32 with "ieee" precision (no tf32).
The result differs from the reference only by fp32 summation order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.utils import FLOAT_DTYPES, check, dot_block


@triton.jit
def tile_slots(slot_ptr, rows, row_mask):
    """(slot of each row, -1 past T; lowest and highest slot >= 0 among them). No slot present:
    lo > hi, so a `range(lo, hi + 1)` over the slots is empty."""
    slot = tl.load(slot_ptr + rows, mask=row_mask, other=-1)
    lo = tl.min(tl.where(slot >= 0, slot, 1 << 30), axis=0)
    hi = tl.max(slot, axis=0)
    return slot, lo, hi


@triton.jit
def lora_delta_tile(
    s_ptr,        # shrunk [T, S*L*R] (row stride stride_s, last dim contiguous), any float dtype
    stride_s,
    b_ptr,        # lora_b [L, N, R] contiguous
    rows,         # int [BLOCK_M]: token rows of the tile
    slot,         # int32 [BLOCK_M]: their slots (-1 = none), from tile_slots
    lo, hi,       # slot range present among them, from tile_slots
    slice_idx,    # slice of the fused output these columns belong to (scalar)
    cols,         # int [BLOCK_N]: output columns (indices into N); masked ones may be anything
    col_mask,     # bool [BLOCK_N]
    N, L, R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,   # >= max(R, 16), a power of two (tl.dot's minimum K is 16)
    DOT_IEEE: tl.constexpr,  # dot in fp32 (see the module docstring)
):
    """fp32 [BLOCK_M, BLOCK_N]: the delta of every (row, column) of the tile."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    s_rows = s_ptr + rows.to(tl.int64)[:, None] * stride_s + offs_r[None, :]      # [M, BR]
    safe_cols = tl.where(col_mask, cols, 0).to(tl.int64)
    b_tile = b_ptr + safe_cols[None, :] * R + offs_r[:, None]                     # [BR, N]
    b_mask = r_mask[:, None] & col_mask[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for l in range(lo, hi + 1):
        sel = slot == l
        if tl.max(sel.to(tl.int32), axis=0) > 0:
            s = tl.load(s_rows + (slice_idx * L + l) * R, mask=sel[:, None] & r_mask[None, :],
                        other=0.0)
            b = tl.load(b_tile + tl.cast(l, tl.int64) * N * R, mask=b_mask, other=0.0)
            if DOT_IEEE:
                acc = tl.dot(s.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(s, b, acc)
    return acc


def row_block(T: int, cap: int = 64) -> int:
    # Token rows per tile: B is read once per tile and slot, so more rows read it less often;
    # a small step keeps 16 (tl.dot's minimum) so its few rows are not spread over padding.
    return max(16, min(cap, triton.next_power_of_2(T)))


def delta_args(lora: LoRADelta, T: int, N: int, num_slices: int, device) -> tuple[tuple, dict]:
    """(kernel args, constexprs) for the lora_delta_tile parameters of a consumer kernel:
    args = (s_ptr, stride_s, b_ptr, slot_ptr, N, L, R), constexprs = BLOCK_R, DOT_IEEE."""
    lora.validate(T, N, num_slices, device)
    L, _, R = lora.lora_b.shape
    sd, bd = lora.shrunk.dtype, lora.lora_b.dtype
    check(sd in FLOAT_DTYPES and bd in FLOAT_DTYPES,
          "LoRA shrunk values and lora_b must be float tensors")
    args = (lora.shrunk, lora.shrunk.stride(0), lora.lora_b, lora.token_slots, N, L, R)
    ieee = not (sd == bd and sd in (torch.float16, torch.bfloat16))
    return args, dict(BLOCK_R=dot_block(R, triton.next_power_of_2(R)), DOT_IEEE=ieee)
