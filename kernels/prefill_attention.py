"""Varlen paged prefill attention: the packed prompt tokens of a whole step in one launch.

The step's queries are packed: sequence b owns rows query_start[b]..query_start[b+1] of q. Its
K/V, this chunk's included, are already in the paged cache (PagedAttention.forward writes them
first), so query j of sequence b sits at position context_len[b] - n_q[b] + j and attends
causally to cache positions 0..that position, read through the block table: earlier chunks of a
chunked prompt and this chunk alike.

One program per (query head, BLOCK_M query tile, sequence); heads are the fastest grid axis, so
the programs of one GQA group run side by side and share the kv head's tiles in L2. Tiles past a
sequence's query count exit at once (the grid is sized by the longest query of the step; prefill
runs eagerly, never inside a CUDA graph). Each program walks the keys BLOCK_N at a time in two
loops: the tiles every row of the query tile sees (no mask), then the few on the causal
diagonal (masked). Softmax is online in fp32, in the exp2 domain; P is rounded to the cache
dtype for the PV dot, like flash attention.

Sliding window: query position p sees keys (p - window, p]. The walk starts at the tile holding
the earliest key any row of the query tile sees, so key tiles wholly before it are skipped, and
has three parts: tiles that cross some row's window edge (masked, loads too: no key before the
window is read), the tiles every row sees whole, the causal diagonal (masked by both edges).
Logit soft-capping: score = cap * tanh(q.k * scale / cap) before the mask. Both are per-layer
constants behind constexpr flags; without them the kernel is the plain one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.paged_attention import tanh
from batchrun.kernels.utils import check, check_attention_inputs

LOG2E = 1.4426950408889634


@triton.jit
def _tile(acc, m_i, l_i, q, k_head, v_head, bt_row, start, lo, hi, pos,
          qk_scale, cap_scale, window, stride_kblk, stride_ktok, stride_vblk, stride_vtok,
          offs_d, d_mask,
          BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
          WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    # One key tile [start, start + BLOCK_N). MASKED: keys outside [lo, hi) are neither read nor
    # seen, and each row sees only keys <= its position (and, with WINDOW, > position - window);
    # lo is only used with WINDOW.
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = offs_n < hi
        if WINDOW:
            n_mask = n_mask & (offs_n >= lo)
        page = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask_t = n_mask[None, :] & d_mask[:, None]
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        page = tl.load(bt_row + offs_n // BLOCK_SIZE).to(tl.int64)
        kv_mask_t = d_mask[:, None]
        kv_mask = d_mask[None, :]
    slot = offs_n % BLOCK_SIZE
    kt = tl.load(k_head + page[None, :] * stride_kblk + slot[None, :] * stride_ktok + offs_d[:, None],
                 mask=kv_mask_t, other=0.0).to(q.dtype)                              # [BD, BN]
    s = tl.dot(q, kt, input_precision="ieee") * qk_scale                             # [BM, BN]
    if SOFTCAP:
        s = tanh(s) * cap_scale
    if MASKED:
        seen = n_mask[None, :] & (offs_n[None, :] <= pos[:, None])
        if WINDOW:
            seen = seen & (offs_n[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
    # finite: every row sees all of an unmasked tile; without a window a masked tile holds key
    # 0, which every row sees, or follows one that did
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if MASKED:
        if WINDOW:
            # With a window a row may have seen no key yet (its window starts past the tiles so
            # far): m_new is -inf, and subtracting 0 instead keeps alpha and p at 0, not NaN.
            # Its own position's key, always seen, comes in a later tile.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head + page[:, None] * stride_vblk + slot[:, None] * stride_vtok + offs_d[None, :],
                mask=kv_mask, other=0.0).to(q.dtype)                                 # [BN, BD]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,            # [T, Hq, D] packed queries
    k_ptr, v_ptr,     # [num_blocks, BLOCK_SIZE, Hkv, D]
    bt_ptr,           # int32 [B, max_blocks]
    qstart_ptr,       # int32 [B + 1]: query_start
    ctx_ptr,          # int32 [B]: context length, this chunk included
    out_ptr,          # [T, Hq, D]
    qk_scale,         # softmax scale * log2(e); with SOFTCAP: softmax scale / softcap; times
                      # k_scale for an FP8 cache
    v_scale,          # an FP8 cache's V scale (1.0 otherwise): the output is acc * v_scale / l
    cap_scale,        # with SOFTCAP: softcap * log2(e) (unused otherwise)
    window,           # with WINDOW: keys visible to each query (unused otherwise)
    G, D,
    stride_qt, stride_qh,
    stride_kblk, stride_ktok, stride_kh,
    stride_vblk, stride_vtok, stride_vh,
    stride_btb,
    stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    h = tl.program_id(0)
    tile = tl.program_id(1)
    b = tl.program_id(2)
    q0 = tl.load(qstart_ptr + b)
    n_q = tl.load(qstart_ptr + b + 1) - q0
    m0 = tile * BLOCK_M
    if m0 < n_q:
        ctx = tl.load(ctx_ptr + b)
        first = ctx - n_q + m0                 # position of the tile's first query
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_mask = offs_m < n_q
        pos = first + tl.arange(0, BLOCK_M)    # padding rows get positions too: harmless
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        rows = (q0 + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)               # [BM, BD]
        kvh = h // G
        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        # keys 0..first are seen by every row (without a window); whole tiles of them need no mask
        full = ((first + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(ctx, first + BLOCK_M)  # one past the last row's position (capped)
        if WINDOW:
            # lo: the earliest key any row sees (the first row's window edge); key tiles wholly
            # before it are skipped. Keys from `all_lo` (the last real row's edge) to `first`
            # are seen by every row: whole tiles of them, [mid, full), need no mask. The tiles
            # [start0, mid) before them cross some row's edge and are masked like the diagonal.
            lo = tl.maximum(first - window + 1, 0)
            start0 = (lo // BLOCK_N) * BLOCK_N
            all_lo = first + tl.minimum(n_q - m0, BLOCK_M) - window
            mid = tl.minimum(tl.maximum(tl.cdiv(all_lo, BLOCK_N) * BLOCK_N, start0), full)
            for start in range(start0, mid, BLOCK_N):
                acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_head, v_head, bt_row, start, lo, hi, pos,
                                      qk_scale, cap_scale, window,
                                      stride_kblk, stride_ktok, stride_vblk, stride_vtok,
                                      offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True, True, SOFTCAP)
        else:
            lo = 0
            mid = 0
        for start in range(mid, full, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_head, v_head, bt_row, start, lo, hi, pos,
                                  qk_scale, cap_scale, window,
                                  stride_kblk, stride_ktok, stride_vblk, stride_vtok,
                                  offs_d, d_mask, BLOCK_SIZE, BLOCK_N, False, WINDOW, SOFTCAP)
        for start in range(full, hi, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, k_head, v_head, bt_row, start, lo, hi, pos,
                                  qk_scale, cap_scale, window,
                                  stride_kblk, stride_ktok, stride_vblk, stride_vtok,
                                  offs_d, d_mask, BLOCK_SIZE, BLOCK_N, True, WINDOW, SOFTCAP)
        if WINDOW:
            # padding rows (never stored) may have seen no key: keep them finite
            l_i = tl.where(l_i > 0, l_i, 1.0)
        out = acc * v_scale / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _blocks(D: int, max_query_len: int, block_size: int) -> tuple[int, int, int, int]:
    # (BLOCK_M, BLOCK_N, num_warps, num_stages). Short prompts get short query tiles (a step of
    # 32-token prompts would waste half of a 64-row tile); tiles never narrower than a page.
    block_m = max(16, min(64 if D > 64 else 128, triton.next_power_of_2(max_query_len)))
    # BLOCK_N 32 beat 64 at D 128 in the sweep of `benchmarks/kernels.py attention --sweep`
    block_n = max(triton.next_power_of_2(block_size), 32 if D > 64 else 64)
    warps = 8 if block_m >= 128 else 4  # 8 warps only pay at 128-row tiles
    return block_m, block_n, warps, 2


def prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                      query_start: Tensor, context_lens: Tensor, max_query_len: int,
                      scale: float, out: Tensor, sliding_window: int | None = None,
                      logit_softcap: float | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0, *, tuning: dict | None = None) -> None:
    # q:            [T, Hq, D]                          the step's queries, packed by sequence
    # k/v_cache:    [num_blocks, block_size, Hkv, D]    this step's K/V already written
    # block_tables: int32 [B, max_blocks_per_seq]       entries past a sequence's blocks ignored
    # query_start:  int32 [B + 1]                       sequence b owns q rows [qs[b], qs[b+1])
    # context_lens: int32 [B]                           cached tokens incl. this chunk (>= n_q)
    # max_query_len: host int >= every n_q              sizes the grid
    # out:          [T, Hq, D]                          every row of a sequence written
    # sliding_window: None, or >= 1: query position p sees keys (p - window, p]
    # logit_softcap:  None, or > 0: scores become softcap * tanh(score / softcap)
    # tuning:       {block_m, block_n, num_warps, num_stages} overrides, for benchmarks only
    T, Hq, D, block_size, Hkv = check_attention_inputs(q, k_cache, v_cache, out, "T")
    B = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check(context_lens.dim() == 1 and context_lens.dtype == torch.int32,
          f"context_lens must be int32 [B], got {context_lens.dtype} {tuple(context_lens.shape)}")
    check(query_start.shape == (B + 1,) and query_start.dtype == torch.int32,
          f"query_start must be int32 [B + 1 = {B + 1}], got {query_start.dtype} {tuple(query_start.shape)}")
    check(block_tables.dim() == 2 and block_tables.shape[0] == B and block_tables.dtype == torch.int32,
          f"block_tables must be int32 [B={B}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    check(q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1
          and v_cache.stride(3) == 1 and block_tables.stride(1) == 1
          and context_lens.is_contiguous() and query_start.is_contiguous(),
          "last dims of q, out, caches and block_tables must be contiguous")
    check(len({t.device for t in (q, k_cache, v_cache, block_tables, query_start, context_lens, out)}) == 1,
          "all tensors must be on one device")
    check(sliding_window is None or sliding_window >= 1,
          f"sliding_window must be None or >= 1, got {sliding_window}")
    check(logit_softcap is None or logit_softcap > 0,
          f"logit_softcap must be None or > 0, got {logit_softcap}")
    if T == 0 or B == 0:
        return
    check(max_query_len >= 1, f"max_query_len must be >= 1, got {max_query_len}")
    block_m, block_n, warps, stages = _blocks(D, max_query_len, block_size)
    if tuning:
        block_m, block_n = tuning.get("block_m", block_m), tuning.get("block_n", block_n)
        warps, stages = tuning.get("num_warps", warps), tuning.get("num_stages", stages)
    check(block_n >= block_size, f"block_n ({block_n}) must be >= the page size ({block_size})")
    block_d = max(16, triton.next_power_of_2(D))
    _prefill_kernel[(Hq, triton.cdiv(max_query_len, block_m), B)](
        q, k_cache, v_cache, block_tables, query_start, context_lens, out,
        k_scale * (scale * LOG2E if logit_softcap is None else scale / logit_softcap), v_scale,
        0.0 if logit_softcap is None else logit_softcap * LOG2E,
        0 if sliding_window is None else sliding_window,
        Hq // Hkv, D,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        WINDOW=sliding_window is not None, SOFTCAP=logit_softcap is not None,
        num_warps=warps, num_stages=stages,
    )
