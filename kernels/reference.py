"""Torch references for the Triton kernels, in fp32 math.

They define what the kernels compute (tests compare against them) and they are what the engine
runs on CPU, so `ref_paged_decode_attention` is vectorised rather than a loop per token.
"""
from __future__ import annotations

import torch
from torch import Tensor


def ref_lora_shrink(x: Tensor, lora_a: Tensor, token_slots: Tensor) -> Tensor:
    # x: [T, K], lora_a: [S, L, R, K], token_slots: int [T] (-1 = no LoRA)
    # returns [S, T, R] fp32: x[t] @ lora_a[s, slot[t]].T, zero rows for slot -1.
    # Loops over slots (few), not tokens, so it is also usable as the CPU path.
    S, L, R, _ = lora_a.shape
    slots = token_slots.to(device=x.device, dtype=torch.long)
    out = torch.zeros(S, x.shape[0], R, dtype=torch.float32, device=x.device)
    for slot in range(L):
        idx = (slots == slot).nonzero().squeeze(1)
        if idx.numel():
            xs = x[idx].float()                                       # [n, K]
            out[:, idx] = torch.einsum("nk,srk->snr", xs, lora_a[:, slot].float())
    return out


def ref_lora_expand(y: Tensor, buf: Tensor, lora_b: Tensor, slice_offsets, token_slots: Tensor) -> Tensor:
    # y: [T, N], buf: [S, >=T, R] fp32, lora_b: [L, N, R], slice_offsets: S + 1 ints
    # returns new y (y's dtype): y[t, o_s:o_s+1] + buf[s, t] @ lora_b[slot[t], o_s:o_s+1].T,
    # computed in fp32 with one rounding; slot -1 rows are returned unchanged.
    L = lora_b.shape[0]
    slots = token_slots.to(device=y.device, dtype=torch.long)
    new = y.clone()
    for slot in range(L):
        idx = (slots == slot).nonzero().squeeze(1)
        if not idx.numel():
            continue
        rows = y[idx].float()                                         # [n, N]
        for s in range(len(slice_offsets) - 1):
            lo, hi = slice_offsets[s], slice_offsets[s + 1]
            rows[:, lo:hi] += buf[s, idx].float() @ lora_b[slot, lo:hi].float().T
        new[idx] = rows.to(y.dtype)
    return new


def ref_paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                               context_lens: Tensor, scale: float) -> Tensor:
    # q: [B, Hq, D], k_cache/v_cache: [num_blocks, block_size, Hkv, D],
    # block_tables: int [B, max_blocks], context_lens: int [B] -> out [B, Hq, D] (q's dtype)
    B, Hq, D = q.shape
    num_blocks, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    lens = context_lens.to(device=q.device, dtype=torch.long)
    # Only gather as many blocks as the longest context needs (host sync: fine for a reference).
    n_blk = max(1, -(-int(lens.max()) // bs)) if B else 1
    n_blk = min(n_blk, block_tables.shape[1])
    # Entries past a sequence's blocks are arbitrary: clamp so the gather is in range; they are
    # masked out below anyway.
    tbl = block_tables[:, :n_blk].to(device=q.device, dtype=torch.long).clamp(0, num_blocks - 1)
    k = k_cache[tbl].reshape(B, n_blk * bs, Hkv, D).float()    # [B, Nctx, Hkv, D]
    v = v_cache[tbl].reshape(B, n_blk * bs, Hkv, D).float()
    qg = q.float().reshape(B, Hkv, G, D)                       # q head h uses kv head h // G
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k) * scale    # [B, Hkv, G, Nctx]
    valid = torch.arange(n_blk * bs, device=q.device)[None, :] < lens[:, None]  # [B, Nctx]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)                   # context_len 0 -> all -inf -> zeros
    out = torch.einsum("bhgn,bnhd->bhgd", probs, v)
    return out.reshape(B, Hq, D).to(q.dtype)
