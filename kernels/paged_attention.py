"""Paged decode attention: one new query token per sequence against its paged KV cache.

One program per (sequence, kv head, context split) computes all query heads of that kv head's
GQA group together (their rows form the M side of the dots, padded to 16), walking the context
BLOCK_N tokens at a time: each token's page comes from the block table, so a tile may span
several pages. Softmax is online (running max / sum) in fp32, in the exp2 domain.

The grid depends only on static shapes (B, Hkv, num_splits) and the loop bound is the context
length read in-kernel, so launches are CUDA-graph capturable. With few sequences x kv heads the
GPU is underfilled, so the context is split (flash-decoding): each split handles an equal share
of its own sequence's context, writes a normalised partial output and its log-sum-exp, and a
second small kernel merges the splits. Rows with context_len 0 get zeros.

Sliding window (Mistral, Qwen2, Gemma): the query at position ctx - 1 sees keys
[max(0, ctx - window), ctx). The loop and the split partition cover only that range, so pages
wholly before it are never read and split counts follow min(capacity, window). Logit
soft-capping (Gemma 2): score = cap * tanh(q.k * scale / cap) before the softmax. Both are
per-layer constants behind constexpr flags: without them the kernel is the plain one.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.pdl import pdl_enter, pdl_kwargs
from batchrun.kernels.utils import check, check_attention_inputs

LOG2E = 1.4426950408889634


@triton.jit
def tanh(x):
    # fp32 tanh from exp2 and a polynomial (no libdevice: the same code runs in the interpreter
    # and on every Triton version the engine meets). |x| >= 0.25: (1 - t) / (1 + t) with
    # t = exp(-2|x|) <= 0.61, so the subtraction loses at most a bit or two. |x| < 0.25: Taylor
    # to x^9, whose first omitted term is < 1e-8 relative there. Saturates to +-1 for large |x|.
    ax = tl.abs(x)
    t = tl.exp2(ax * (-2.0 * 1.4426950408889634))
    big = (1.0 - t) / (1.0 + t)
    big = tl.where(x < 0, -big, big)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(ax < 0.25, small, big)


@triton.jit
def _paged_decode_kernel(
    # pointers
    q_ptr,            # [B, Hq, D]
    k_ptr, v_ptr,     # [num_blocks, BLOCK_SIZE, Hkv, D]
    bt_ptr,           # int32 [B, max_blocks]
    lens_ptr,         # int32 [B]
    out_ptr,          # [B, Hq, D]                        (NUM_SPLITS == 1)
    part_out_ptr,     # fp32 [B, Hq, NUM_SPLITS, D]        (NUM_SPLITS > 1)
    part_lse_ptr,     # fp32 [B, Hq, NUM_SPLITS], log2 domain
    # sizes
    qk_scale,         # softmax scale * log2(e); with SOFTCAP: softmax scale / softcap; times
                      # k_scale for an FP8 cache
    v_scale,          # an FP8 cache's V scale (1.0 otherwise): the output is acc * v_scale / l
    cap_scale,        # with SOFTCAP: softcap * log2(e) (unused otherwise)
    window,           # with WINDOW: keys visible to the query (unused otherwise)
    G, D,             # query heads per kv head, head dim
    # strides (last dims are contiguous)
    stride_qb, stride_qh,
    stride_kblk, stride_ktok, stride_kh,
    stride_vblk, stride_vtok, stride_vh,
    stride_btb,
    stride_ob, stride_oh,
    # constexprs
    BLOCK_SIZE: tl.constexpr,   # KV cache page size
    BLOCK_N: tl.constexpr,      # context tokens per loop iteration
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WINDOW: tl.constexpr,       # sliding window on: keys [max(0, ctx - window), ctx) only
    SOFTCAP: tl.constexpr,      # logit soft-capping on
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    # The visible keys are [first, ctx): the query sits at ctx - 1.
    if WINDOW:
        first = tl.maximum(ctx - window, 0)
    else:
        first = 0
    # This split's share of the visible keys, whole tiles only (empty for short contexts' tail
    # splits). Tiles start at `first` itself, so every token of a tile below hi is visible.
    chunk = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + sp * chunk
    hi = tl.minimum(ctx, lo + chunk)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)        # [BG, BD]

    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        # Table entries past the context are arbitrary: never read them (nor their pages).
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot_in_page = offs_n % BLOCK_SIZE
        kv_mask = n_mask[None, :] & d_mask[:, None]
        k_ptrs = k_head + page[None, :] * stride_kblk + slot_in_page[None, :] * stride_ktok + offs_d[:, None]
        kt = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)                   # [BD, BN]
        s = tl.dot(q, kt, input_precision="ieee") * qk_scale                         # [BG, BN]
        if SOFTCAP:
            s = tanh(s) * cap_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))   # finite: the tile has >= 1 valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_head + page[:, None] * stride_vblk + slot_in_page[:, None] * stride_vtok + offs_d[None, :]
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # l_i == 0 only when this program saw no tokens: emit zeros, not NaN.
    out = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = b.to(tl.int64) * (G * tl.num_programs(1)) + heads                     # b * Hq + head
        p_ptrs = part_out_ptr + (row[:, None] * NUM_SPLITS + sp) * D + offs_d[None, :]
        tl.store(p_ptrs, out, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row * NUM_SPLITS + sp, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    # pointers
    part_out_ptr,     # fp32 [B, Hq, NUM_SPLITS, D]
    part_lse_ptr,     # fp32 [B, Hq, NUM_SPLITS]
    out_ptr,          # [B, Hq, D]
    # sizes
    Hq, D,
    # strides
    stride_ob, stride_oh,
    # constexprs
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b.to(tl.int64) * Hq + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < D
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)   # all splits empty (context 0): weights all 0
    w = tl.exp2(lse - m)                                                            # [BS]
    parts = tl.load(part_out_ptr + (row * NUM_SPLITS + offs_s[:, None]) * D + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)              # [BS, BD]
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(programs: int, max_ctx: int, sms: int) -> int:
    """Context splits for `programs` = B * Hkv (sequence, kv head) programs whose queries can
    see up to `max_ctx` keys (the block table's capacity, or the sliding window when shorter)
    on a GPU of `sms` SMs.

    Split only when the programs cannot fill the GPU (fewer than 2 per SM) and contexts can be
    long; otherwise the merge kernel costs more than it saves. Splits aim at 4 programs per SM
    and keep >= 256 tokens of capacity each (`benchmarks/kernels.py attention --sweep` picks
    these). Static inputs only, so a captured graph's split count never changes
    (short actual contexts leave the tail splits empty)."""
    if max_ctx < 1024 or programs >= 2 * sms:
        return 1
    return max(1, min(-(-4 * sms // programs), max_ctx // 256, 16))


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                           context_lens: Tensor, scale: float, out: Tensor,
                           sliding_window: int | None = None, logit_softcap: float | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           *, num_splits: int | None = None, tuning: dict | None = None) -> None:
    # q:            [B, Hq, D]                          one new token per sequence
    # k/v_cache:    [num_blocks, block_size, Hkv, D]    one layer's paged cache, Hq % Hkv == 0
    # block_tables: int32 [B, max_blocks_per_seq]       entries past a sequence's blocks ignored
    # context_lens: int32 [B]                           tokens to attend to; 0 -> zeros in out
    # out:          [B, Hq, D]                          written for every row
    # sliding_window: None, or >= 1: the query (position ctx - 1) sees keys [ctx - window, ctx)
    # logit_softcap:  None, or > 0: scores become softcap * tanh(score / softcap)
    # k_scale, v_scale: an e4m3 cache's scales (its values times the scale are K and V)
    # num_splits:   context splits (None = heuristic from static shapes); must stay fixed
    #               between graph capture and replay, which it does when left None.
    # tuning:       {block_n, num_warps, num_stages} overrides, for benchmarks only.
    B, Hq, D, block_size, Hkv = check_attention_inputs(q, k_cache, v_cache, out, "B")
    check(block_tables.dim() == 2 and block_tables.shape[0] == B and block_tables.dtype == torch.int32,
          f"block_tables must be int32 [B={B}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    check(context_lens.shape == (B,) and context_lens.dtype == torch.int32,
          f"context_lens must be int32 [B={B}], got {context_lens.dtype} {tuple(context_lens.shape)}")
    check(q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1
          and v_cache.stride(3) == 1 and block_tables.stride(1) == 1 and context_lens.is_contiguous(),
          "last dims of q, out, caches and block_tables must be contiguous")
    check(len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens, out)}) == 1,
          "all tensors must be on one device")
    check(sliding_window is None or sliding_window >= 1,
          f"sliding_window must be None or >= 1, got {sliding_window}")
    check(logit_softcap is None or logit_softcap > 0,
          f"logit_softcap must be None or > 0, got {logit_softcap}")
    if B == 0:
        return

    G = Hq // Hkv
    block_g = max(16, triton.next_power_of_2(G))
    block_d = max(16, triton.next_power_of_2(D))
    # Tiles of 64 tokens amortise the loop overhead; never smaller than a page.
    block_n = max(triton.next_power_of_2(block_size), 64 if block_d <= 128 else 32)
    warps, stages = 4, 2
    if tuning:
        block_n = tuning.get("block_n", block_n)
        warps, stages = tuning.get("num_warps", warps), tuning.get("num_stages", stages)
    check(block_n >= block_size, f"block_n ({block_n}) must be >= the page size ({block_size})")
    max_ctx = block_tables.shape[1] * block_size
    if sliding_window is not None:
        max_ctx = min(max_ctx, sliding_window)  # the most keys one query sees
    if num_splits is None:
        num_splits = 1
        if q.device.type == "cuda":
            dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
            num_splits = decode_num_splits(B * Hkv, max_ctx, _num_sms(dev))
    check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
    splits = num_splits
    if splits > 1:
        part_out = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, Hq, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel
    _paged_decode_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        k_scale * (scale * LOG2E if logit_softcap is None else scale / logit_softcap), v_scale,
        0.0 if logit_softcap is None else logit_softcap * LOG2E,
        0 if sliding_window is None else sliding_window,
        G, D,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_D=block_d,
        NUM_SPLITS=splits, WINDOW=sliding_window is not None, SOFTCAP=logit_softcap is not None,
        num_warps=warps, num_stages=stages, **pdl_kwargs(q),
    )
    if splits > 1:
        _merge_splits_kernel[(B, Hq)](
            part_out, part_lse, out,
            Hq, D,
            out.stride(0), out.stride(1),
            NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
            num_warps=4, **pdl_kwargs(q),
        )
