"""LoRA expand (Punica SGMV): y[t, slice s] += (sum_k buf[k, s, t]) @ lora_b[slot[t], slice s].T.

buf holds lora_shrink's split-K partial products ([SPLIT, S, T_max, R] fp32); each program sums
the SPLIT partials of its [BLOCK_M, R] tile in registers as it loads them (a fixed order, so the
result is deterministic) and then does the dot with B as before.

lora_b is stored in the fused output layout of the base layer ([L, N, R]; slice s is rows
slice_offsets[s]:slice_offsets[s+1], scaling folded in), so one launch covers q/k/v or gate/up
even when slices differ in size (GQA). Grid = (m-blocks x n-blocks of the widest slice, slices,
max_loras + 1): static shapes only, so it can be captured in a CUDA graph. Programs whose n-block
lies past their slice's end, whose entry is unused, or whose m-block is past the entry's token
count return at once; slot -1 rows of y are never read or written.

Precision: buf is fp32 but tensor-core dots need both operands in the weights' dtype. Rounding
buf to bf16 would add an error as large as the final rounding, so 16-bit weights get buf split
into hi + lo halves (two dots, exact to ~2^-16): the result is the fp32 product with one rounding
to y's dtype, as the contract asks. The dots are nowhere near the bottleneck (R <= 128).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.lora_shrink import MAX_SPLITS
from batchrun.kernels.utils import FLOAT_DTYPES, check, dot_block

MAX_RANK = 256  # one R tile per program


@triton.jit
def _lora_expand_kernel(
    # pointers
    buf_ptr,          # [SPLIT, S, T_max, R] fp32 partials
    b_ptr,            # [L, N, R]
    y_ptr,            # [T, N]
    sorted_ids_ptr,   # int32 [max_tokens]
    active_ptr,       # int32 [L + 1]
    count_ptr,        # int32 [L + 1]
    start_ptr,        # int32 [L + 1]
    # sizes
    R, MAX_SLICE_N,
    OFF0, OFF1, OFF2, OFF3,  # slice_offsets padded to 4 entries (unused ones = N)
    # strides (last dims are contiguous)
    stride_bufk, stride_bufs, stride_buft,
    stride_bl, stride_bn,
    stride_yt,
    # constexprs
    SPLIT: tl.constexpr,       # partials to sum
    SPLIT_BLOCK: tl.constexpr,  # partials loaded per step (a power of two, bounds registers)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    SPLIT_BUF: tl.constexpr,   # 16-bit weights: dot buf as hi + lo halves
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    entry = tl.program_id(2)
    num_n = tl.cdiv(MAX_SLICE_N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n

    slot = tl.load(active_ptr + entry)
    if slot < 0:
        return
    count = tl.load(count_ptr + entry)
    if pid_m * BLOCK_M >= count:
        return
    n_lo = tl.where(s == 0, OFF0, tl.where(s == 1, OFF1, OFF2))
    n_hi = tl.where(s == 0, OFF1, tl.where(s == 1, OFF2, OFF3))
    n0 = n_lo + pid_n * BLOCK_N
    if n0 >= n_hi:  # this slice is narrower than the widest one
        return
    start = tl.load(start_ptr + entry)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_hi
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R

    buf_ptrs = buf_ptr + s.to(tl.int64) * stride_bufs + tok[:, None] * stride_buft + offs_r[None, :]
    mr_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT == 1:
        bt = tl.load(buf_ptrs, mask=mr_mask, other=0.0)                            # [BM, BR] fp32
    else:
        # Unrolled: every group's loads are independent, so they are all in flight at once.
        offs_sp = tl.arange(0, SPLIT_BLOCK)
        bt = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in tl.static_range(0, SPLIT, SPLIT_BLOCK):
            sp = k0 + offs_sp
            part = tl.load(buf_ptrs[None, :, :] + sp[:, None, None] * stride_bufk,
                           mask=(sp < SPLIT)[:, None, None] & mr_mask[None, :, :], other=0.0)
            bt += tl.sum(part, axis=0)                                              # [BM, BR]
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None]
    wt = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)        # [BR, BN]

    if SPLIT_BUF:
        hi = bt.to(wt.dtype)
        lo = (bt - hi.to(tl.float32)).to(wt.dtype)
        acc = tl.dot(hi, wt)
        acc = tl.dot(lo, wt, acc)
    else:
        acc = tl.dot(bt, wt, input_precision="ieee")

    y_ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _config(T: int, R: int, max_slice_n: int, splits: int) -> tuple[int, int, int, int, int]:
    # Decode is memory-bound on lora_b and y: many small programs, wide enough n-blocks for
    # coalesced rows.
    block_m = 16 if T <= 128 else 32 if T <= 1024 else 64
    block_r = dot_block(R, MAX_RANK)
    block_n = min(128 if block_r <= 64 else 64, dot_block(max_slice_n, 128))
    # Partials summed per step: at most 4096 fp32 values (32 registers per thread at 4 warps).
    split_block = max(1, min(triton.next_power_of_2(splits), 4096 // (block_m * block_r)))
    # Decode at small rank (the hot case) fits 4 warps in ~80 registers; bigger tiles (and the
    # summed partials) spill there, so they get 8.
    num_warps = 4 if block_m * block_n <= 2048 and block_r <= 32 else 8
    return block_m, block_n, block_r, split_block, num_warps


def lora_expand(buf: Tensor, lora_b: Tensor, y: Tensor, slice_offsets: tuple[int, ...],
                meta: LoRAKernelMeta) -> None:
    # buf:    [SPLIT, S, T_max, R] fp32 partials from lora_shrink (summed over SPLIT here)
    # lora_b: [L, N, R]     fused output layout, scaling folded in, dtype of y
    # y:      [T, N]        base output, updated in place for tokens with a slot
    # slice_offsets: S + 1 python ints, 0 = first < ... < last = N
    # meta:   prepared for these T tokens, the same metadata lora_shrink used
    check(buf.dim() == 4 and lora_b.dim() == 3 and y.dim() == 2,
          f"expected buf [SPLIT, S, T_max, R], lora_b [L, N, R], y [T, N]; got "
          f"{tuple(buf.shape)}, {tuple(lora_b.shape)}, {tuple(y.shape)}")
    splits, S, T_max, R = buf.shape
    L, N, Rb = lora_b.shape
    T = y.shape[0]
    offs = tuple(int(o) for o in slice_offsets)
    check(1 <= S <= 3, f"1 to 3 slices supported, got {S}")
    check(1 <= splits <= MAX_SPLITS, f"buf must have 1 to {MAX_SPLITS} splits, got {splits}")
    check(len(offs) == S + 1 and offs[0] == 0 and offs[-1] == N
          and all(a < b for a, b in zip(offs, offs[1:])),
          f"slice_offsets must be S+1={S + 1} increasing ints from 0 to N={N}, got {offs}")
    check(buf.dtype == torch.float32, f"buf must be float32, got {buf.dtype}")
    check(y.dtype in FLOAT_DTYPES and lora_b.dtype == y.dtype,
          f"y and lora_b must share a float dtype, got {y.dtype} and {lora_b.dtype}")
    check(y.shape[1] == N, f"y has {y.shape[1]} columns, lora_b has N={N}")
    check(Rb == R and R <= MAX_RANK, f"rank mismatch or too large: buf R={R}, lora_b R={Rb}")
    check(T_max >= T, f"buf holds {T_max} tokens, y has {T}")
    check(buf.stride(3) == 1 and lora_b.is_contiguous() and y.stride(1) == 1,
          "buf rows, lora_b and y rows must be contiguous")
    check(T <= meta.max_tokens, f"{T} tokens exceed the metadata capacity {meta.max_tokens}")
    check(meta.active_slots.shape[0] == L + 1,
          f"meta was allocated for {meta.active_slots.shape[0] - 1} slots, lora_b has {L}")
    check(buf.device == lora_b.device == y.device == meta.active_slots.device,
          "buf, lora_b, y and meta must be on one device")
    if T == 0:
        return

    max_slice_n = max(b - a for a, b in zip(offs, offs[1:]))
    padded = offs + (N,) * (4 - len(offs))
    block_m, block_n, block_r, split_block, num_warps = _config(T, R, max_slice_n, splits)
    grid = (triton.cdiv(T, block_m) * triton.cdiv(max_slice_n, block_n), S, L + 1)
    _lora_expand_kernel[grid](
        buf, lora_b, y,
        meta.sorted_token_ids, meta.active_slots, meta.slot_token_count, meta.slot_token_start,
        R, max_slice_n,
        *padded,
        buf.stride(0), buf.stride(1), buf.stride(2),
        lora_b.stride(0), lora_b.stride(1),
        y.stride(0),
        SPLIT=splits, SPLIT_BLOCK=split_block,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        SPLIT_BUF=(y.dtype != torch.float32),
        num_warps=num_warps, num_stages=1,
    )
