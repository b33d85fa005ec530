"""LoRA shrink (Punica SGMV), split over K: out[k, s, t, :] = x[t, chunk k] @ lora_a[s, slot[t], :, chunk k].T.

Decode has a handful of tokens, so without a split over K only ~S programs run, each streaming
all of K serially: latency-bound far above the launch floor. Each program here covers one K chunk
of one m-block of the LoRA tokens (gathered through sorted_token_ids) and stores its fp32
partial product into its own split row of `out`; `lora_expand` sums the SPLIT partials when it
loads them. Every partial of every LoRA token is written (an empty tail chunk stores zeros), so
nothing needs pre-zeroing, there are no atomics and the sum order is fixed (deterministic); rows
of slot -1 tokens are never touched.

Grid = (splits x m-blocks x rank-blocks, slices): there is no program per slot entry. The LoRA
tokens fill one run of sorted_token_ids (entries back to back, see lora_meta), each program
covers one m-block of that run whatever entries it spans, and walks the entries itself, a few at
a time (their A loads overlap), each row keeping its own entry's product. At decode one m-block
holds every LoRA token, so 1 active adapter of 8 costs no idle programs and 8 adapters do not
serialize on 8 dependent loads. The grid depends only on static shapes, so the launch can be
captured in a CUDA graph and replayed after `LoRAKernelMeta.prepare` rewrites the metadata. The
split count comes from `shrink_num_splits(T, K, S)`, a pure function of the same static shapes;
callers size `out` with it (out.shape[0] is the split count).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.utils import FLOAT_DTYPES, check, dot_block

MAX_SPLITS = 32        # largest split count callers must size buffers for (forced values)
_NUM_SMS = 132          # H100/H200; only steers the split heuristic
_MIN_SPLIT_K = 512      # K per program below which a split costs more than it saves
_MAX_AUTO_SPLITS = 8    # lora_expand sums every partial: more splits make it slower


def _block_m(num_tokens: int) -> int:
    # Decode (small T) is short of programs: small m-blocks give more programs in flight.
    return 16 if num_tokens <= 128 else 32 if num_tokens <= 1024 else 64


def shrink_num_splits(num_tokens: int, K: int, num_slices: int) -> int:
    """Number of K splits (a power of two, 1.._MAX_AUTO_SPLITS) for `lora_shrink` on these shapes.

    Doubles the split while the programs (m-blocks x slices x splits) do not yet fill the GPU's
    SMs, each program keeps at least _MIN_SPLIT_K of K, and the split stays <= 8: lora_expand
    loads and sums every partial, and on the H200 16-32 partials cost it 1-3 us, more than the
    shrink saves over 8 splits (decode: one 512..1536-wide chunk per program, 2-6 tiles in
    flight). Static shapes only, so a captured graph and its buffer views agree on it for every
    replay. The kernels accept any split count up to MAX_SPLITS.
    """
    programs = triton.cdiv(max(num_tokens, 1), _block_m(num_tokens)) * num_slices
    splits = 1
    while (splits < _MAX_AUTO_SPLITS and programs * splits < _NUM_SMS
           and K // (2 * splits) >= _MIN_SPLIT_K):
        splits *= 2
    return splits


@triton.jit
def _lora_shrink_kernel(
    # pointers
    x_ptr,            # [T, K]
    a_ptr,            # [S, L, R, K]
    out_ptr,          # [SPLIT, S, T_max, R] fp32
    sorted_ids_ptr,   # int32 [MAX_TOKENS]
    active_ptr,       # int32 [NUM_ENTRIES]
    count_ptr,        # int32 [NUM_ENTRIES]
    start_ptr,        # int32 [NUM_ENTRIES]
    # sizes
    K, R, CHUNK_K,    # CHUNK_K: K per split, a multiple of BLOCK_K
    MAX_TOKENS,       # length of sorted_token_ids
    # strides (last dims are contiguous)
    stride_xt,
    stride_as, stride_al, stride_ar,
    stride_ok, stride_os, stride_ot,
    # constexprs
    NUM_ENTRIES: tl.constexpr,  # max_loras + 1
    ENTRY_BLOCK: tl.constexpr,  # entries handled per step (unrolled: their loads overlap)
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,   # K % BLOCK_K == 0: no tile needs a K mask
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    num_n = tl.cdiv(R, BLOCK_N)
    pid_k = pid % SPLIT
    pid_mn = pid // SPLIT
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n

    # Metadata layout (lora_meta): present slots first, ascending, each entry a run of
    # sorted_token_ids; slot -1 tokens (and padding) sort first. So the LoRA tokens are exactly
    # sorted positions [start[0], MAX_TOKENS), entry by entry, and this program's m-block is
    # positions p0 .. p0 + BLOCK_M of that run, whatever entries they belong to.
    if tl.load(active_ptr) < 0:
        return  # no LoRA token this step
    p0 = tl.load(start_ptr) + pid_m * BLOCK_M
    if p0 >= MAX_TOKENS:
        return
    p_end = p0 + BLOCK_M
    offs_p = p0 + tl.arange(0, BLOCK_M)
    m_mask = offs_p < MAX_TOKENS
    tok = tl.load(sorted_ids_ptr + offs_p, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < R
    k0 = tl.multiple_of(pid_k * CHUNK_K, BLOCK_K)  # tiles stay aligned: vector loads
    offs_k = tl.arange(0, BLOCK_K)
    # K left in this chunk (0 for empty tail chunks: the loop is skipped and zeros are stored).
    k_len = tl.maximum(tl.minimum(CHUNK_K, K - k0), 0)
    a_s = a_ptr + s.to(tl.int64) * stride_as + offs_n[None, :] * stride_ar + (k0 + offs_k)[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    zero = pid * 0  # entry indices as tensors (the interpreter's loop counters are ints)
    for g in range(0, NUM_ENTRIES, ENTRY_BLOCK):
        # Entries g .. g + ENTRY_BLOCK cover positions [g_lo, g_hi): skip the group unless it
        # has a present slot and overlaps this m-block (decode: one group, one m-block).
        g_slot = tl.load(active_ptr + g)
        g_lo = tl.load(start_ptr + g)
        nxt = zero + g + ENTRY_BLOCK
        nxt_c = tl.minimum(nxt, NUM_ENTRIES - 1)  # clamped index, no scalar masks
        nxt_on = (nxt < NUM_ENTRIES) & (tl.load(active_ptr + nxt_c) >= 0)
        g_hi = tl.where(nxt_on, tl.load(start_ptr + nxt_c), MAX_TOKENS)
        if (g_slot >= 0) & (g_lo < p_end) & (g_hi > p0):
            x_ptrs = x_ptr + tok[:, None] * stride_xt + (k0 + offs_k)[None, :]          # [BM, BK]
            for k in range(0, tl.cdiv(k_len, BLOCK_K)):
                if EVEN_K:  # no K mask: loads stay vectorized along K
                    x_mask = m_mask[:, None]
                else:
                    k_mask = offs_k < k_len - k * BLOCK_K
                    x_mask = m_mask[:, None] & k_mask[None, :]
                xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
                for j in tl.static_range(ENTRY_BLOCK):
                    e = zero + g + j
                    e_c = tl.minimum(e, NUM_ENTRIES - 1)
                    slot = tl.load(active_ptr + e_c)
                    lo = tl.load(start_ptr + e_c)
                    hi = lo + tl.load(count_ptr + e_c)
                    # Absent entries and entries outside this m-block load nothing.
                    use = (e < NUM_ENTRIES) & (slot >= 0) & (lo < p_end) & (hi > p0)
                    hi = tl.where(use, hi, lo)  # an unused entry owns no row
                    a_ptrs = a_s + tl.maximum(slot, 0).to(tl.int64) * stride_al + k * BLOCK_K
                    a_mask = (offs_n < tl.where(use, R, 0))[None, :]
                    if not EVEN_K:
                        a_mask = a_mask & k_mask[:, None]
                    at = tl.load(a_ptrs, mask=a_mask, other=0.0)
                    # "ieee": exact fp32 products for fp32 inputs (no tf32); no effect for
                    # 16-bit inputs. Each row keeps only its own entry's product.
                    rows = (offs_p >= lo) & (offs_p < hi)
                    acc += tl.where(rows[:, None], tl.dot(xt, at, input_precision="ieee"), 0.0)
                x_ptrs += BLOCK_K

    out_ptrs = (out_ptr + pid_k.to(tl.int64) * stride_ok + s.to(tl.int64) * stride_os
                + tok[:, None] * stride_ot + offs_n[None, :])
    tl.store(out_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


def _config(T: int, R: int, K: int, splits: int, elem_bytes: int) -> tuple[int, ...]:
    block_m = _block_m(T)
    block_n = dot_block(R, 64)
    # Rows of 256 B per K-tile, no wider than one split's share of K: a decode program does
    # 4 (K=4096) to 11 (K=11008) tiles with up to 4 in flight. 512 B tiles with several entries'
    # A tiles live spilled at rank 16 on an sm_90 compile (255 registers); 256 B: 240, none.
    block_k = 256 // elem_bytes
    block_k = min(block_k, dot_block(triton.cdiv(K, splits), 256))
    chunk_k = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    # Stages as deep as ~160 KB of shared memory allows (H100/H200 have 227 KB per SM), and no
    # deeper than the loop: short loops keep shared memory small so several programs share an SM.
    stage_bytes = (block_m + block_n) * block_k * elem_bytes
    iters = chunk_k // block_k
    num_stages = max(2, min(4, iters + 1, (160 * 1024) // stage_bytes))
    return block_m, block_n, block_k, chunk_k, 4, num_stages


def _entry_block(num_entries: int, a_tile: int) -> int:
    # Entries per unrolled step: their A tiles load together (8 adapters at decode: two steps,
    # not four to eight dependent ones), bounded so the tiles fit in registers (<= 4K elements;
    # decode rank 16: 2 entries of a 128 x 16 tile).
    return max(1, min(num_entries, 4, 4096 // a_tile))


def lora_shrink(x: Tensor, lora_a: Tensor, out: Tensor, meta: LoRAKernelMeta) -> None:
    # x:      [T, K]                fp16/bf16/fp32, contiguous rows
    # lora_a: [S, L, R, K]          stacked A weights, same dtype as x, R = max_lora_rank (zero padded)
    # out:    [SPLIT, S, T_max, R]  fp32, T_max >= T, SPLIT = number of K splits (any >= 1; use
    #                               shrink_num_splits(T, K, S)); for tokens with a slot every
    #                               split's partial is overwritten (their sum is x @ A.T); rows of
    #                               slot -1 tokens are left untouched
    # meta:   prepared for these T tokens (meta.prepare(token_slots[:T])): its groups index x rows
    check(x.dim() == 2 and lora_a.dim() == 4 and out.dim() == 4,
          f"expected x [T, K], lora_a [S, L, R, K], out [SPLIT, S, T_max, R]; got "
          f"{tuple(x.shape)}, {tuple(lora_a.shape)}, {tuple(out.shape)}")
    T, K = x.shape
    S, L, R, Ka = lora_a.shape
    splits = out.shape[0]
    check(x.dtype in FLOAT_DTYPES and lora_a.dtype == x.dtype,
          f"x and lora_a must share a float dtype, got {x.dtype} and {lora_a.dtype}")
    check(out.dtype == torch.float32, f"out must be float32, got {out.dtype}")
    check(Ka == K, f"lora_a K={Ka} does not match x K={K}")
    check(1 <= S <= 3, f"1 to 3 slices supported, got {S}")
    check(1 <= splits <= MAX_SPLITS, f"out must have 1 to {MAX_SPLITS} splits, got {splits}")
    check(out.shape[1] == S and out.shape[2] >= T and out.shape[3] == R,
          f"out must be [SPLIT, S={S}, >= {T}, R={R}], got {tuple(out.shape)}")
    check(x.stride(1) == 1 and lora_a.is_contiguous() and out.stride(3) == 1,
          "x rows, lora_a and out rows must be contiguous")
    check(T <= meta.max_tokens, f"{T} tokens exceed the metadata capacity {meta.max_tokens}")
    check(meta.active_slots.shape[0] == L + 1,
          f"meta was allocated for {meta.active_slots.shape[0] - 1} slots, lora_a has {L}")
    check(x.device == lora_a.device == out.device == meta.active_slots.device,
          "x, lora_a, out and meta must be on one device")
    if T == 0:
        return

    block_m, block_n, block_k, chunk_k, num_warps, num_stages = _config(
        T, R, K, splits, x.element_size())
    # No program per slot entry: each program walks the entries itself (see the kernel).
    grid = (splits * triton.cdiv(T, block_m) * triton.cdiv(R, block_n), S)
    _lora_shrink_kernel[grid](
        x, lora_a, out,
        meta.sorted_token_ids, meta.active_slots, meta.slot_token_count, meta.slot_token_start,
        K, R, chunk_k, meta.max_tokens,
        x.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        NUM_ENTRIES=L + 1, ENTRY_BLOCK=_entry_block(L + 1, block_k * block_n),
        SPLIT=splits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=(K % block_k == 0),
        num_warps=num_warps, num_stages=num_stages,
    )
