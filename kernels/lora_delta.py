"""LoRA delta over a tile of token rows x output columns: device functions that the elementwise
kernels after each projection (rotary, RMSNorm, SiLU-and-mul) call on a LoRA step, so the delta
costs no launch of its own.

Where the inputs come from (batchrun/engine/lora/layer.py): a LoRA-able Linear keeps its weight and
the A matrices of every slot in one tensor [N + L*S*R, K], slot-major, so on a LoRA step one base
GEMM over its first N + k*S*R rows also computes the shrink of slots 0..k-1 (k = the step's slot
bound, every token's slot < k): columns N.. of its output hold `shrunk[t, (l*S + s)*R + r] =
x[t] . A[s, l, r]` for every slot l < k, slice s and rank r. The consumer then adds, for token t
with slot l = slot[t] >= 0 and output column n of slice s,

    delta[t, n] = sum_r shrunk[t, (l*S + s)*R + r] * B[l, n, r]        (fp32 accumulation)

with B stored [L, N, R] (fused output layout, scaling folded in). Tokens with slot -1 (no LoRA,
padding) get 0. The caller rounds `y + delta` once to the model dtype, which is what a separate
expand kernel writing y would have produced.

Why tiles: a program owns BLOCK_M rows x BLOCK_N columns. It gathers each row's own slot's
shrunk values s [M, R] once (tile_shrunk) and then, for each slot l of the tile's [min, max]
slot range, does one tensor-core dot `where(slot == l, s, 0) [M, R] @ B_l[cols].T [R, N]`.
So B is read once per tile and slot instead of once per token row (at 256 rows the per-row
form read B 256 times a step). Rows need not be sorted by slot: rows of other slots (and slot
-1) enter each dot as zeros, so the masked sum is exact (for finite B: a non-finite B of one
adapter would reach the tile's other rows as 0 * inf). But the loop is shortest when they are:
prompt rows come in runs of one sequence, and the engine orders a LoRA decode step's rows by
slot (engine.py), so most tiles run one or two iterations.

Small steps gather instead (GATHER, steps of at most GATHER_MAX_ROWS = 8 rows: the latency
workload's decode of 8 rows): a tile of 8 rows with 8 adapters would walk 8 slots one after
another, each a dependent B load and a mostly-empty 16-row dot. lora_delta_rows loads every
row's own slot's B columns at once ([rows, cols, rank chunk] gathers, no loop-carried
dependency between them) and reduces over the rank in fp32 registers, as the per-row consumers
before the tiles did; rows of one slot share those B lines in L1. Tile rows then need not be
16 (no tl.dot), so a step of T <= GATHER_MAX_ROWS rows is one tile of next_power_of_2(T) rows.

The consumers launch with num_stages=1: the slot loop is short, and software pipelining only
added shared memory and registers (2-3 stages ran slower at 256 and 8192 rows).

Precision: 16-bit s and B of the same dtype are dotted as they are (their products are exact in
fp32, accumulated in fp32); any other pair is dotted in fp32 with "ieee" precision (no tf32).
The result differs from the reference only by fp32 summation order.
"""
from __future__ import annotations

from typing import Final

import torch
import triton
import triton.language as tl

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
def tile_shrunk(s_ptr, stride_s, rows, slot, slice_idx, S, R,
                BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr):
    """[BLOCK_M, BLOCK_R]: each row's own slot's shrunk values of one slice (0 for slot -1 and
    past R), in the dot's operand dtype; S = slices of the shrunk layout. One gather per tile
    and slice."""
    offs_r = tl.arange(0, BLOCK_R)
    own = (tl.maximum(slot, 0) * S + slice_idx) * R
    s = tl.load(s_ptr + rows.to(tl.int64)[:, None] * stride_s + own[:, None] + offs_r[None, :],
                mask=(slot >= 0)[:, None] & (offs_r < R)[None, :], other=0.0)
    if DOT_IEEE:
        s = s.to(tl.float32)
    return s


@triton.jit
def _slot_dot(acc, s, sel, b, DOT_IEEE: tl.constexpr):
    s_l = tl.where(sel[:, None], s, tl.zeros_like(s))
    if DOT_IEEE:
        return tl.dot(s_l, b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(s_l, b, acc)


@triton.jit
def lora_delta_tile(
    s,            # [BLOCK_M, BLOCK_R] from tile_shrunk
    s2,           # PAIR: the second slice's [BLOCK_M, BLOCK_R] (else unused: pass s)
    b_ptr,        # lora_b [L, N, R] contiguous
    slot,         # int32 [BLOCK_M]: the rows' slots (-1 = none), from tile_slots
    lo, hi,       # slot range present among them, from tile_slots
    cols,         # int [BLOCK_N]: output columns (indices into N); masked ones may be anything
    cols2,        # PAIR: the second slice's columns (same mask)
    col_mask,     # bool [BLOCK_N]
    N, R,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,      # >= max(R, 16), a power of two (tl.dot's minimum K is 16)
    DOT_IEEE: tl.constexpr,     # dot in fp32 (see the module docstring)
    PAIR: tl.constexpr,         # also the delta of (s2, cols2), in the same slot loop
):
    """fp32 [BLOCK_M, BLOCK_N] delta of every (row, column) of the tile, and with PAIR the
    second one (else zeros)."""
    offs_r = tl.arange(0, BLOCK_R)
    b_mask = (offs_r < R)[:, None] & col_mask[None, :]
    b_tile = b_ptr + tl.where(col_mask, cols, 0).to(tl.int64)[None, :] * R + offs_r[:, None]
    b_tile2 = b_ptr + tl.where(col_mask, cols2, 0).to(tl.int64)[None, :] * R + offs_r[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One B tile (two with PAIR) and one dot per slot of [lo, hi]: a tile of prompt rows or of
    # slot-sorted decode rows has one or two slots, so this is one or two iterations; a slot
    # of the range that no row uses costs a wasted load of B (its dot adds zeros). An unrolled
    # group of 8 predicated slots instead held 8 B tiles in registers (occupancy) and cost
    # 2-4x the plain kernel's time at one adapter.
    for l in range(lo, hi + 1):
        sel = slot == l
        b_off = tl.cast(l, tl.int64) * N * R
        acc = _slot_dot(acc, s, sel, tl.load(b_tile + b_off, mask=b_mask, other=0.0), DOT_IEEE)
        if PAIR:
            acc2 = _slot_dot(acc2, s2, sel, tl.load(b_tile2 + b_off, mask=b_mask, other=0.0),
                             DOT_IEEE)
    return acc, acc2


@triton.jit
def lora_delta_rows(
    s_ptr, stride_s,  # shrunk [T, k*S*R], slot-major
    b_ptr,            # lora_b [L, N, R] contiguous
    rows, slot,       # int [BLOCK_M]: the tile's rows and their slots (-1 = none), from tile_slots
    slice_idx, slice_idx2,   # slices of cols and (PAIR) cols2
    cols, cols2, col_mask,   # as in lora_delta_tile
    N, S, R,         # S: slices of the shrunk layout
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,   # >= R, a power of two
    R_CHUNK: tl.constexpr,   # ranks per gather (bounds registers: BLOCK_M * BLOCK_N * R_CHUNK)
    PAIR: tl.constexpr,
):
    """The same fp32 [BLOCK_M, BLOCK_N] delta(s) as lora_delta_tile, by gathering each row's own
    slot's B columns (GATHER mode, small steps: see the module docstring)."""
    valid = slot >= 0
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    s_row = s_ptr + rows.to(tl.int64) * stride_s
    b_row = b_ptr + slot64 * N * R
    c3 = tl.where(col_mask, cols, 0).to(tl.int64)[None, :, None] * R
    c3b = tl.where(col_mask, cols2, 0).to(tl.int64)[None, :, None] * R
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in tl.static_range(0, BLOCK_R, R_CHUNK):
        offs_r = r0 + tl.arange(0, R_CHUNK)
        s_mask = valid[:, None] & (offs_r < R)[None, :]
        b_mask = s_mask[:, None, :] & col_mask[None, :, None]
        b_at = b_row[:, None, None] + offs_r[None, None, :]
        s = tl.load(s_row[:, None] + ((slot64 * S + slice_idx) * R)[:, None] + offs_r[None, :],
                    mask=s_mask, other=0.0).to(tl.float32)
        b = tl.load(b_at + c3, mask=b_mask, other=0.0).to(tl.float32)
        acc += tl.sum(b * s[:, None, :], axis=2)
        if PAIR:
            s2 = tl.load(s_row[:, None] + ((slot64 * S + slice_idx2) * R)[:, None] + offs_r[None, :],
                         mask=s_mask, other=0.0).to(tl.float32)
            b2 = tl.load(b_at + c3b, mask=b_mask, other=0.0).to(tl.float32)
            acc2 += tl.sum(b2 * s2[:, None, :], axis=2)
    return acc, acc2


# Steps of at most this many token rows add the delta with lora_delta_rows (GATHER) instead of
# the slot loop; a constant (the row count is static per CUDA graph, so each captured shape
# keeps its form). 8: up to 8 rows the gather wins or ties the slot loop on 7b shapes, at 16
# rows the slot loop wins (`benchmarks/kernels.py consumers`; decision log in docs/benchmarks.md).
GATHER_MAX_ROWS: Final = 8


def row_block(T: int, cap: int = 32) -> int:
    # Token rows per tile: B is read once per tile and slot, so more rows read it less often;
    # a small step keeps 16 (tl.dot's minimum) so its few rows are not spread over padding.
    # The cap of 32 (with 64 columns and 4 warps) keeps the consumers near 100-170 registers
    # on sm_90 (ptxas), several programs per SM; 64-row tiles need ~200-250 (one per SM).
    # A GATHER step (no tl.dot) is one tile of exactly next_power_of_2(T) rows.
    if T <= GATHER_MAX_ROWS:
        return triton.next_power_of_2(max(T, 1))
    return max(16, min(cap, triton.next_power_of_2(T)))


def gather_consts(T: int, block_m: int, block_n: int, block_r: int, pairs: int = 1) -> dict:
    """GATHER and R_CHUNK constexprs of a consumer launch over T rows in [block_m, block_n]
    tiles; ``pairs`` = 2 when the kernel gathers two B tiles per chunk (PAIR)."""
    budget = 4096 // pairs  # gathered B values per chunk: ~32 fp32 registers a thread at 4 warps
    chunk = max(1, min(block_r, budget // (block_m * block_n)))
    return dict(GATHER=T <= GATHER_MAX_ROWS, R_CHUNK=1 << (chunk.bit_length() - 1))


def delta_args(lora: LoRADelta, T: int, N: int, num_slices: int, device) -> tuple[tuple, dict]:
    """(kernel args, constexprs) for the LoRA parameters of a consumer kernel:
    args = (s_ptr, stride_s, b_ptr, slot_ptr, N, S, R), constexprs = BLOCK_R, DOT_IEEE."""
    lora.validate(T, N, num_slices, device)
    _, _, R = lora.lora_b.shape
    sd, bd = lora.shrunk.dtype, lora.lora_b.dtype
    check(sd in FLOAT_DTYPES and bd in FLOAT_DTYPES,
          "LoRA shrunk values and lora_b must be float tensors")
    args = (lora.shrunk, lora.shrunk.stride(0), lora.lora_b, lora.token_slots, N, num_slices, R)
    ieee = not (sd == bd and sd in (torch.float16, torch.bfloat16))
    return args, dict(BLOCK_R=dot_block(R, triton.next_power_of_2(R)), DOT_IEEE=ieee)
