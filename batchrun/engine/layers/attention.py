"""Paged attention for one layer: write this step's K/V into the paged cache, then attend.
On CUDA the rotary kernel before it writes the K/V (kv_write); on CPU the layer copies them.

KV cache layout per layer: [num_blocks, block_size, Hkv, D]. Block 0 is a scratch block
never given to a sequence: padded rows of a captured decode step write their K/V there.

Prefill (possibly a chunk of a long prompt): each sequence's queries attend to its whole cached
context (earlier chunks + this chunk), causally. On the Triton path (CUDA) one varlen kernel
covers the step's packed tokens, reading K/V through the block table
(kernels/prefill_attention.py); on CPU it is done per sequence with torch SDPA on K/V gathered
through the block table (exact and fast enough there). Decode: one query per sequence, Triton
paged kernel on CUDA, torch reference on CPU (same math; the engine's CPU path is torch by design).

A mixed step (scheduler.py) is a prefill step whose first `num_decode` sequences are decode
rows of one query each: two launches, those rows through the decode kernel (the math a decode
step does for them; no BLOCK_M-row query tile wasted on one query) and the others through the
prefill kernel, which reads its sequences' rows through query_start, so both write disjoint
rows of one output without copies.

Sliding window (Mistral, Qwen2, Gemma) and attention-logit soft-capping (Gemma 2) are per-layer
constants, with transformers' eager semantics: score = q.k * scale, then
cap * tanh(score / cap), then the mask (key j visible to the query at position i iff j <= i
and i - j < window), then softmax in fp32. The kernels take them as launch constants (a captured
decode graph keeps them); the CPU path builds the window mask for SDPA, or computes the scores
itself when capped (SDPA cannot cap).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from batchrun.engine.layers.backend import use_triton


@dataclass
class AttnMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [T]: flat cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq]
    context_lens: torch.Tensor  # int32 [B]: cached tokens to attend to, this step's included
    # prefill only (host ints; prefill attention always runs eagerly, between the pieces of a
    # piecewise prefill graph at most: prefill_graphs.py):
    query_lens: list[int] | None = None
    context_lens_host: list[int] | None = None
    query_start: torch.Tensor | None = None  # int32 [B + 1] on device: cumsum of query_lens
    num_decode: int = 0  # mixed step: sequences [0, num_decode) are decode rows, 1 query each


class KVWrite(NamedTuple):
    """Where a step's K/V go: one layer's caches and each token's flat slot (int64 [T]); an
    e4m3 cache stores K / k_scale and V / v_scale."""
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        # scale: None = head_dim ** -0.5; sliding_window: None or >= 1 keys (the query's own
        # included); logit_softcap: None or > 0
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.k_cache: torch.Tensor | None = None  # set by the model runner after KV sizing
        self.v_cache: torch.Tensor | None = None
        # an FP8 (e4m3) cache holds K / k_scale and V / v_scale: the checkpoint's scales
        # (compressed-tensors kv_cache_scheme) or 1.0, as vLLM does without them. Host floats:
        # fixed once loaded, so captured graphs may keep them as launch constants.
        self.k_scale, self.v_scale = 1.0, 1.0
        self.checkpoint_kv_scales = (1.0, 1.0)  # the loader's, taken when the cache is e4m3
        # set while a piecewise prefill forward is captured (prefill_graphs.py): the forward
        # then ends its graph piece here and returns the static attention output instead
        self.split = None

    def kv_write(self, meta: AttnMetadata) -> KVWrite:
        """Where this step's K/V go, for a kernel before the attention that can write them
        (the rotary on CUDA: no copy launches of its own)."""
        return KVWrite(self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)

    def forward(self, q, k, v, meta: AttnMetadata) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]. k = v = None: this step's K/V are
        # already in the cache (written through kv_write by the rotary kernel).
        if self.split is not None:
            return self.split(self, q, k, v, meta)
        return self.attend(q, k, v, meta)

    def attend(self, q, k, v, meta: AttnMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        # forward without the split; out (prefill only): [>= T, Hq, D] written at the rows of
        # the step's sequences (a piecewise prefill's static buffer), other rows left as they are
        kc, vc = self.k_cache, self.v_cache
        if k is not None:
            flat_k = kc.view(-1, self.num_kv_heads, self.head_dim)  # [blocks*block_size, Hkv, D]
            flat_v = vc.view(-1, self.num_kv_heads, self.head_dim)
            # (as bytes: torch's CPU index_copy_ has no e4m3 kernel)
            flat_k.view(torch.uint8).index_copy_(
                0, meta.slot_mapping, to_cache(k, kc.dtype, self.k_scale).view(torch.uint8))
            flat_v.view(torch.uint8).index_copy_(
                0, meta.slot_mapping, to_cache(v, vc.dtype, self.v_scale).view(torch.uint8))
        if meta.is_prefill:
            return self._prefill(q, meta, out)
        out = torch.empty_like(q)
        decode_attention(q, kc, vc, meta.block_tables, meta.context_lens, self.scale, out,
                         self.sliding_window, self.logit_softcap, self.k_scale, self.v_scale)
        return out

    def _prefill(self, q: torch.Tensor, meta: AttnMetadata,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        nd = meta.num_decode
        out = torch.empty_like(q) if out is None else out
        if nd:  # decode rows own q rows [0, nd): one query per sequence
            decode_attention(q[:nd], self.k_cache, self.v_cache, meta.block_tables[:nd],
                             meta.context_lens[:nd], self.scale, out[:nd],
                             self.sliding_window, self.logit_softcap, self.k_scale, self.v_scale)
        if nd == len(meta.query_lens):
            return out
        if use_triton(q):
            from batchrun.kernels.prefill_attention import prefill_attention
            if meta.query_start is None:
                raise ValueError("AttnMetadata.query_start (int32 [B + 1], cumsum of query_lens) "
                                 "is required for prefill on the Triton path; build it with "
                                 "query_start_tensor(query_lens, device)")
            # query_start[nd:] still holds absolute rows, so the kernel writes rows nd.. of out
            prefill_attention(q, self.k_cache, self.v_cache, meta.block_tables[nd:],
                              meta.query_start[nd:], meta.context_lens[nd:],
                              max(meta.query_lens[nd:]), self.scale, out,
                              self.sliding_window, self.logit_softcap, self.k_scale, self.v_scale)
        else:
            rows = self._prefill_per_sequence(q, meta, nd)  # q may have padding rows past them
            out[nd:nd + rows.shape[0]] = rows
        return out

    def _prefill_per_sequence(self, q: torch.Tensor, meta: AttnMetadata,
                              first: int = 0) -> torch.Tensor:
        """Sequences first.. (whose rows start at q row `first`: the ones before hold one each)."""
        block_size = self.k_cache.shape[1]
        outs, start = [], first
        for i in range(first, len(meta.query_lens)):
            n_q, n_ctx = meta.query_lens[i], meta.context_lens_host[i]
            n_blocks = -(-n_ctx // block_size)
            # keys from `lo` on: with a window, none before the first query's window is gathered
            lo = 0 if self.sliding_window is None else max(0, n_ctx - n_q - self.sliding_window + 1)
            b0 = lo // block_size
            blocks = meta.block_tables[i, b0:n_blocks].long()
            # gather this sequence's context: [n_blocks - b0, bs, Hkv, D] -> [n_ctx - lo, Hkv, D]
            k = gather_blocks(self.k_cache, blocks).flatten(0, 1)[lo - b0 * block_size:n_ctx - b0 * block_size]
            v = gather_blocks(self.v_cache, blocks).flatten(0, 1)[lo - b0 * block_size:n_ctx - b0 * block_size]
            k, v = from_cache(k, q.dtype, self.k_scale), from_cache(v, q.dtype, self.v_scale)
            qi = q[start:start + n_q]
            outs.append(_causal_sdpa(qi, k, v, self.scale, n_ctx - n_q - lo,
                                     self.sliding_window, self.logit_softcap))
            start += n_q
        return torch.cat(outs, dim=0)


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks], also for an e4m3 cache (gathered as bytes: torch's CPU indexing has no
    e4m3 kernel)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache[blocks]
    return cache.view(torch.uint8)[blocks].view(cache.dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """K or V as the cache stores them: e4m3 of x / scale, saturated at +-448 (the rotary
    kernel's rounding on CUDA), or x itself."""
    if cache_dtype != torch.float8_e4m3fn:
        return x
    return (x.float() / scale).clamp(-448.0, 448.0).to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached K or V back in the model dtype (e4m3 times its scale)."""
    if x.dtype != torch.float8_e4m3fn:
        return x
    return (x.float() * scale).to(dtype)


def query_start_tensor(query_lens: list[int], device) -> torch.Tensor:
    """int32 [B + 1]: where each sequence's rows start in the packed prefill tokens."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def _causal_sdpa(q, k, v, scale, offset: int, sliding_window: int | None = None,
                 logit_softcap: float | None = None) -> torch.Tensor:
    # q: [Nq, Hq, D]; k, v: [Nk, Hkv, D]; query j sits at position offset + j, key i at i;
    # query position p sees keys <= p, and with a window only those > p - window
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:  # GQA: each kv head serves hq // hkv query heads
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, D]
    nq, nk = q.shape[0], k.shape[0]
    if sliding_window is None and logit_softcap is None:
        if offset == 0:
            o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=scale)
        else:
            mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=offset)
            o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale)
        return o.squeeze(0).transpose(0, 1)  # [Nq, Hq, D]
    # every row keeps its own position's key, so no row is all -inf
    gap = (offset + torch.arange(nq, device=q.device))[:, None] - torch.arange(nk, device=q.device)
    mask = gap >= 0
    if sliding_window is not None:
        mask &= gap < sliding_window
    if logit_softcap is None:
        o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=scale)
    else:
        # transformers' eager attention in its op order and dtypes: scores in q's dtype,
        # capped, masked, softmax in fp32 rounded back to q's dtype, then @ v
        scores = torch.matmul(q_, k_.transpose(2, 3)) * scale
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, v_)
    return o.squeeze(0).transpose(0, 1)  # [Nq, Hq, D]


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out,
                     sliding_window: int | None = None, logit_softcap: float | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    # One query per sequence (at position context_len - 1) into out: [B, Hq, D]
    if use_triton(q):
        from batchrun.kernels.paged_attention import paged_decode_attention
        paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out,
                               sliding_window, logit_softcap, k_scale, v_scale)
    else:
        from batchrun.kernels.reference import ref_paged_decode_attention
        out.copy_(ref_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                             sliding_window, logit_softcap, k_scale, v_scale))
