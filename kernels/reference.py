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


def ref_lora_shrink_rows(x: Tensor, lora_a: Tensor, token_slots: Tensor, k: int) -> Tensor:
    # x: [T, K], lora_a: [S, L, R, K], token_slots: int [>= T] (-1 = no LoRA, else < k)
    # returns [T, k*S*R] in x's dtype laid out like LoRADelta.shrunk: row t's own slot l holds
    # columns (l*S + s)*R + r = rnd(x[t] . A[s, l, r]) (fp32 sum, one rounding); every other
    # column is 0 (kernels/rms_norm_shrink.py leaves those unwritten).
    T = x.shape[0]
    S, _, R, _ = lora_a.shape
    slots = token_slots[:T].to(device=x.device, dtype=torch.long)
    own = ref_lora_shrink(x, lora_a, slots).permute(1, 0, 2).reshape(T, S * R)  # [T, S*R]
    out = torch.zeros(T, k, S * R, dtype=x.dtype, device=x.device)
    has = (slots >= 0).nonzero().squeeze(1)
    out[has, slots[has]] = own[has].to(x.dtype)
    return out.reshape(T, k * S * R)


def ref_lora_delta(y: Tensor, shrunk: Tensor, lora_b: Tensor, slice_offsets, token_slots: Tensor) -> Tensor:
    # y: [T, N]; shrunk: [T, k*S*R], k <= L, with column (l*S + s)*R + r = x[t] . A[s, l, r]
    # (the fused base GEMM's extra columns, slots 0..k-1); lora_b: [L, N, R]; token_slots:
    # int [>= T] (-1 = no LoRA, else < k).
    # Returns new y: y + shrunk[t, slice s, slot[t]] @ lora_b[slot[t], slice s].T, fp32 math,
    # one rounding (ref_lora_expand on the token's own slot's shrunk values).
    T = y.shape[0]
    _, _, R = lora_b.shape
    S = len(slice_offsets) - 1
    slots = token_slots[:T].to(device=y.device, dtype=torch.long)
    per_slot = shrunk.float().reshape(T, -1, S, R)  # [T, k, S, R]
    assert bool((slots < per_slot.shape[1]).all()), "a token's slot is past the shrunk slots"
    mid = per_slot[torch.arange(T, device=y.device), slots.clamp(min=0)]  # [T, S, R]
    return ref_lora_expand(y, mid.transpose(0, 1), lora_b, slice_offsets, slots)


def _capped(scores: Tensor, logit_softcap: float | None) -> Tensor:
    # Attention-logit soft-capping in transformers' order: (scores / cap).tanh() * cap.
    if logit_softcap is None:
        return scores
    return torch.tanh(scores / logit_softcap) * logit_softcap


def _gather(cache: Tensor, idx: Tensor) -> Tensor:
    # cache[idx], for e4m3 caches too (as bytes: torch's CPU indexing has no e4m3 kernel)
    if cache.dtype != torch.float8_e4m3fn:
        return cache[idx]
    return cache.view(torch.uint8)[idx].view(cache.dtype)


def ref_paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                               context_lens: Tensor, scale: float, sliding_window: int | None = None,
                               logit_softcap: float | None = None, k_scale: float = 1.0,
                               v_scale: float = 1.0) -> Tensor:
    # q: [B, Hq, D], k_cache/v_cache: [num_blocks, block_size, Hkv, D],
    # block_tables: int [B, max_blocks], context_lens: int [B] -> out [B, Hq, D] (q's dtype).
    # The query sits at position ctx - 1 and sees keys [0, ctx), or with a sliding window
    # [max(0, ctx - window), ctx); scores = q.k * scale, then soft-capped when logit_softcap.
    B, Hq, D = q.shape
    num_blocks, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    lens = context_lens.to(device=q.device, dtype=torch.long)
    # Each row gathers its blocks from the one holding its first visible key: with a window,
    # blocks wholly before it are never read (this is the engine's CPU path too).
    first = (lens - sliding_window).clamp(min=0) if sliding_window is not None else torch.zeros_like(lens)
    first_blk = first // bs                                    # [B]
    # As many blocks as the widest row needs (host sync: fine for a reference).
    n_blk = max(1, int((-(-lens // bs) - first_blk).max())) if B else 1
    n_blk = min(n_blk, block_tables.shape[1])
    # Entries past a sequence's blocks are arbitrary: clamp so the gather is in range; they are
    # masked out below anyway.
    cols = (first_blk[:, None] + torch.arange(n_blk, device=q.device)).clamp(max=block_tables.shape[1] - 1)
    tbl = block_tables.to(device=q.device, dtype=torch.long).gather(1, cols).clamp(0, num_blocks - 1)
    # an e4m3 cache holds K / k_scale and V / v_scale
    k = _gather(k_cache, tbl).reshape(B, n_blk * bs, Hkv, D).float() * k_scale  # [B, N, Hkv, D]
    v = _gather(v_cache, tbl).reshape(B, n_blk * bs, Hkv, D).float() * v_scale
    qg = q.float().reshape(B, Hkv, G, D)                       # q head h uses kv head h // G
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k) * scale    # [B, Hkv, G, N]
    scores = _capped(scores, logit_softcap)
    pos = first_blk[:, None] * bs + torch.arange(n_blk * bs, device=q.device)[None, :]  # [B, N]
    valid = (pos >= first[:, None]) & (pos < lens[:, None])
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)                   # context_len 0 -> all -inf -> zeros
    out = torch.einsum("bhgn,bnhd->bhgd", probs, v)
    return out.reshape(B, Hq, D).to(q.dtype)


def ref_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                          query_start: Tensor, context_lens: Tensor, scale: float,
                          sliding_window: int | None = None, logit_softcap: float | None = None,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> Tensor:
    # q: [T, Hq, D] packed by sequence (sequence b owns rows query_start[b]..query_start[b+1]),
    # k_cache/v_cache: [num_blocks, block_size, Hkv, D] with this step's K/V already written,
    # block_tables: int [B, max_blocks], context_lens: int [B] (this chunk included)
    # -> out [T, Hq, D] (q's dtype). Query j of sequence b sits at position
    # p = context_lens[b] - n_q + j and attends to cache positions 0..p, or with a sliding
    # window to those in (p - window, p]; scores = q.k * scale, soft-capped when logit_softcap.
    # fp32 math, one sequence at a time (host ints: a reference, not the engine's CPU path).
    T, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(T, Hq, D, dtype=torch.float32, device=q.device)
    starts, ctxs = query_start.tolist(), context_lens.tolist()
    for b, n_ctx in enumerate(ctxs):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        blocks = block_tables[b, :-(-n_ctx // bs)].to(device=q.device, dtype=torch.long)
        k = (_gather(k_cache, blocks).flatten(0, 1)[:n_ctx].float() * k_scale).repeat_interleave(G, dim=1)
        v = (_gather(v_cache, blocks).flatten(0, 1)[:n_ctx].float() * v_scale).repeat_interleave(G, dim=1)
        scores = torch.einsum("qhd,nhd->hqn", q[lo:hi].float(), k) * scale         # [Hq, nq, N]
        scores = _capped(scores, logit_softcap)
        pos = n_ctx - (hi - lo) + torch.arange(hi - lo, device=q.device)
        keys = torch.arange(n_ctx, device=q.device)[None, :]
        visible = keys <= pos[:, None]                                             # [nq, N]
        if sliding_window is not None:
            visible &= pos[:, None] - keys < sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[lo:hi] = torch.einsum("hqn,nhd->qhd", probs, v)
    return out.to(q.dtype)

# --- elementwise ops (RMSNorm, rotary, act-and-mul): HF op order, also the engine's CPU path ---

def ref_rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    # x: [..., H], weight: [H] -> [..., H], normed over the last dim.
    # offset 0: HF LlamaRMSNorm: fp32 normalise, cast to x's dtype, THEN multiply by weight (in
    # the promoted dtype, i.e. the model dtype).
    # offset != 0: HF GemmaRMSNorm (offset 1): fp32 normalise, multiply by (offset + weight) in
    # fp32, THEN cast to x's dtype.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0.0:
        return weight * xf.to(dtype)
    return (xf * (offset + weight.float())).to(dtype)


def ref_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                           offset: float = 0.0):
    # x, residual: [T, H] -> (normed [T, H], new residual [T, H]); new tensors, inputs untouched.
    # The add is in the model dtype, like HF's `hidden_states = residual + hidden_states`.
    residual = residual + x
    return ref_rms_norm(residual, weight, eps, offset), residual


def ref_rotary(x: Tensor, cos_sin: Tensor, positions: Tensor) -> Tensor:
    # x: [T, H, D], cos_sin: fp32 [P, R] = cat(cos, sin) of the R/2 frequencies, R (the rotary
    # dim, even) <= D, positions: [T] -> new [T, H, D]. HF order in x's dtype on the first R
    # dims: (x * cos) + (rotate_half(x) * sin), cos/sin cast to x's dtype first (three
    # roundings per element: two products and the sum); dims R.. pass through unchanged
    # (partial rotary, as transformers' apply_rotary_pos_emb).
    R = cos_sin.shape[-1]
    cos, sin = cos_sin[positions.long()].chunk(2, dim=-1)           # [T, R/2] each
    cos = torch.cat([cos, cos], -1).unsqueeze(1).to(x.dtype)       # [T, 1, R]
    sin = torch.cat([sin, sin], -1).unsqueeze(1).to(x.dtype)
    if R < x.shape[-1]:
        return torch.cat([_rotate(x[..., :R], cos, sin), x[..., R:]], dim=-1)
    return _rotate(x, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def ref_act_and_mul(gate_up: Tensor, activation: str = "silu") -> Tensor:
    # gate_up: [T, 2I] -> [T, I]: act(gate) (rounded to the input dtype) * up, like HF's gated
    # MLP; activation "silu" (F.silu) or "gelu_tanh" (F.gelu(approximate="tanh"), HF's
    # gelu_pytorch_tanh).
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    raise ValueError(f"unknown activation {activation!r}: silu or gelu_tanh")


# --- decode GEMMs of few rows (skinny_gemm, skinny_gate_up_silu) ---

def ref_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    # x: [M, K], w: [N, K], bias: [N] or None -> [M, N] in x's dtype: fp32 products and sums,
    # bias added in fp32, one rounding (what a GEMM with an fp32 accumulator computes).
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def ref_gate_up_silu(x: Tensor, w: Tensor, activation: str = "silu") -> Tensor:
    # x: [M, K], w: [2I, K] (gate rows, then up rows) -> [M, I]: the gate_up projection rounded
    # to x's dtype, then act-and-mul as HF's MLP computes it.
    return ref_act_and_mul(ref_linear(x, w), activation)


# --- mixture of experts (fused_moe) ---

def ref_fused_moe(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
                  topk_ids: Tensor, activation: str = "silu") -> Tensor:
    # x: [T, H]; w_gate_up: [E, 2I, H] (each expert's gate rows, then up rows, transformers 5's
    # fused expert layout); w_down: [E, H, I]; topk_weights: [T, k] fp32 (already normalised the
    # way the family routes); topk_ids: int [T, k] in [0, E).
    # Returns [T, H] in x's dtype: sum_j topk_weights[t, j] * down_e(act_and_mul(gate_up_e(x[t])))
    # with e = topk_ids[t, j]; each expert's gate_up and down rounded to x's dtype as HF's
    # per-expert linears do, the weighted sum in fp32, one rounding at the end. Loops over
    # experts (not tokens), so it is also the CPU path.
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids = topk_ids.to(device=x.device, dtype=torch.long)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        h = ref_act_and_mul(ref_linear(x[tok], w_gate_up[e]), activation)
        y = ref_linear(h, w_down[e]).float()
        out.index_add_(0, tok, y * topk_weights[tok, j].float().unsqueeze(1))
    return out.to(x.dtype)


# --- FP8 (e4m3) linear layers (fp8_quant, fp8_gemm) ---

FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row's scale (vLLM's floor): never 0


def ref_quant_fp8(x: Tensor, group: int | None = None, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    # x: [M, K] -> (x_q e4m3 [M, K], scales fp32). Dynamic (scale None): one scale per row
    # ([M, 1]) or per row and group of `group` columns ([M, ceil(K / group)]; the last group may
    # be narrower), amax / 448 floored at FP8_MIN_SCALE; static: the given scale ([1] or []),
    # returned as [1, 1]. x_q = clamp(x / scale, +-448) rounded to nearest e4m3.
    xf = x.float()
    M, K = xf.shape
    if scale is not None:
        s = scale.float().reshape(1, 1)
        full = s
    elif group is None:
        s = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        full = s
    else:
        groups = -(-K // group)
        padded = torch.nn.functional.pad(xf.abs(), (0, groups * group - K))
        s = (padded.view(M, groups, group).amax(dim=2) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        full = s.repeat_interleave(group, dim=1)[:, :K]
    xq = (xf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq, s


def ref_dequant_fp8(q: Tensor, scale: Tensor, block: tuple[int, int] | None = None) -> Tensor:
    # q: e4m3 [N, K]; scale fp32: [N] / [N, 1] / [1] / [] (one per row or one for all), or
    # [ceil(N/bn), ceil(K/bk)] with block (bn, bk) -> fp32 [N, K] = q * its scale
    qf = q.float()
    N, K = qf.shape
    if block is not None:
        bn, bk = block
        full = scale.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
        return qf * full
    s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
    return qf * s


def ref_fp8_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, activations: str,
                   block: tuple[int, int] | None = None, input_scale: Tensor | None = None,
                   bias: Tensor | None = None) -> Tensor:
    # The declared FP8 math of a linear layer, in fp32: x [M, K] quantized as `activations`
    # says ("token": per row; "tensor": one dynamic scale for all of x; "static": input_scale;
    # "group": per row and block[1] columns), times the dequantized weight (w_q e4m3 [N, K],
    # w_scale per row or per block), bias added in fp32, rounded once to x's dtype.
    if activations == "tensor":
        amax = x.float().abs().amax().reshape(1)
        xq, xs = ref_quant_fp8(x, scale=(amax / FP8_MAX).clamp(min=FP8_MIN_SCALE))
    elif activations == "static":
        xq, xs = ref_quant_fp8(x, scale=input_scale)
    elif activations == "group":
        xq, xs = ref_quant_fp8(x, group=block[1])
    else:
        xq, xs = ref_quant_fp8(x)
    if activations == "group":
        xd = ref_dequant_fp8(xq, xs, (1, block[1]))
    else:
        xd = xq.float() * xs
    y = xd @ ref_dequant_fp8(w_q, w_scale, block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def ref_lora_linear(x: Tensor, w: Tensor, lora_a: Tensor, lora_b: Tensor, slots: Tensor) -> Tensor:
    # x: [n, K], w: [N, K], lora_a: [L, R, K], lora_b: [L, N, R] (scaling folded in), slots:
    # int [n] (-1 = no adapter) -> [n, N] in x's dtype: the base linear rounded (ref_linear),
    # plus for rows of slot l the delta rnd(x . A_l) @ B_l.T in fp32 (the shrink rounded to the
    # dtype, as a fused base GEMM over [W; A] computes it), rounded once; slot -1 rows are the
    # base linear's values.
    y = ref_linear(x, w)
    slots = slots.to(device=x.device, dtype=torch.long)
    for slot in slots[slots >= 0].unique().tolist():
        idx = (slots == slot).nonzero().squeeze(1)
        shrunk = ref_linear(x[idx], lora_a[slot]).float()
        y[idx] = (y[idx].float() + shrunk @ lora_b[slot].float().t()).to(x.dtype)
    return y


def ref_fused_moe_lora(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
                       topk_ids: Tensor, lora_a_gate_up: Tensor, lora_b_gate_up: Tensor,
                       lora_a_down: Tensor, lora_b_down: Tensor, token_slots: Tensor,
                       activation: str = "silu") -> Tensor:
    # ref_fused_moe with expert LoRA: token t's adapter slot l = token_slots[t] (-1 = none)
    # adds, on each expert e it routes to, ref_lora_linear's delta with A/B of (l, e) to the
    # gate_up projection (before the activation) and to the down projection (before the
    # weighted sum). lora_a_gate_up [L, E, R, H], lora_b_gate_up [L, E, 2I, R], lora_a_down
    # [L, E, R, I], lora_b_down [L, E, H, R]; token_slots int [>= T].
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids = topk_ids.to(device=x.device, dtype=torch.long)
    slots = token_slots[:T].to(device=x.device, dtype=torch.long)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        gate_up = ref_lora_linear(x[tok], w_gate_up[e], lora_a_gate_up[:, e],
                                  lora_b_gate_up[:, e], slots[tok])
        h = ref_act_and_mul(gate_up, activation)
        y = ref_lora_linear(h, w_down[e], lora_a_down[:, e], lora_b_down[:, e], slots[tok]).float()
        out.index_add_(0, tok, y * topk_weights[tok, j].float().unsqueeze(1))
    return out.to(x.dtype)
