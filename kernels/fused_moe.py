"""The mixture-of-experts feed-forward of a step: kernels/reference.py's ref_fused_moe in Triton.

Each token t goes to k experts (topk_ids [T, k]) with weights topk_weights [T, k]. A "slot" is
one (token, choice) pair, s = t * k + j, M = T * k slots in all. Three launches compute it:

  gate_up   h[s] = act_and_mul(x[t] @ W_gate_up[e].T)   e = topk_ids[t, j]; h: [M, I]
  down      y[s] = h[s] @ W_down[e].T                   y: [M, H], x's dtype
  sum       out[t] = sum_j topk_weights[t, j] * y[t*k + j]

with the roundings of the reference: gate and up rounded to x's dtype before the activation
(kernels/act_and_mul.py's `_act_mul`), each expert's down output rounded to x's dtype (the value
the reference's per-expert linear returns, so y loses nothing by being stored in that dtype),
then the weighted sum over the k choices in fp32 and one rounding. The result differs from the
reference only by fp32 summation order (inside the GEMMs and across the k choices). fp32 inputs
are dotted with "ieee" precision (no tf32).

The two grouped GEMMs work on blocks of rows that all use one expert, so each program streams
one expert's weight tiles. Two ways of forming the blocks, picked on shape alone
(`use_decode_path`: M <= DECODE_MAX_SLOTS):

- Sorted (prefill, large batches). `moe_align` sorts the slots by expert and pads each expert's
  run to a multiple of BLOCK_M: sorted_ids [P] holds slot ids, padding = M, and expert_ids[b]
  the expert of block b (-1 past the last run). P is the fixed bound
  M + min(E, M) * (BLOCK_M - 1) (each used expert pads at most BLOCK_M - 1 slots) rounded up
  to whole blocks, so the grid depends only on shapes and the whole op, align included, runs
  on the GPU without a host sync and can be captured in a CUDA graph (torch ops: scatter_add,
  cumsum, a stable argsort, scatter, searchsorted). Blocks past the last run exit at once:
  empty experts cost no blocks beyond the bound.
- Decode (M <= 64 slots). No align step: program b of the grid (one per slot) takes the expert
  e of slot b; if an earlier slot has the same expert it exits, else its rows are all the slots
  routed to e (one tile of next_power_of_2(M) >= 16 rows, masked). So each selected expert's
  weights are streamed exactly once (per column tile), as kernels/skinny_gemm.py streams a
  dense weight, and no other expert's are read.

`fused_moe_lora` adds expert LoRA (ref_fused_moe_lora) in the same three launches: the
grouped GEMMs get a HAS_LORA constexpr (off, they are the plain kernels), shrink each row
against its adapter's A in their K loop and add the expand in their epilogue.

topk_ids are not range-checked (that would need a host sync): the caller's router gives ids in
[0, E). Launches take the PDL constexpr of kernels/pdl.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.act_and_mul import ACTIVATIONS, _act_mul
from batchrun.kernels.pdl import pdl_enter, pdl_kwargs
from batchrun.kernels.utils import FLOAT_DTYPES, check

# At most this many slots (T * k) take the decode path: its row tile is every slot of the step
# (next_power_of_2(M) rows), so it is capped at 64 rows (a [64, BLOCK_K] x tile per stage beside
# the weight tiles); 64 covers k = 8 at 8 tokens, the latency workload's decode batch. Above it
# the sorted path's align ops are spread over more rows.
DECODE_MAX_SLOTS = 64
# (BLOCK_N, BLOCK_K, num_stages, num_warps) of each path's GEMMs: decode streams narrow weight
# tiles over long K steps (kernels/skinny_gemm.py's shape); the sorted path is a tiled GEMM.
DECODE_CONFIG = (32, 128, 3, 4)
SORTED_CONFIG = (64, 64, 3, 4)


def use_decode_path(num_tokens: int, top_k: int) -> bool:
    """The static rule: the decode path at T * k <= DECODE_MAX_SLOTS slots, else sorted."""
    return num_tokens * top_k <= DECODE_MAX_SLOTS


def sorted_block_m(num_slots: int, num_experts: int) -> int:
    """BLOCK_M of the sorted path: about the mean slots per expert, a power of two in [16, 64]
    (tl.dot's minimum; smaller blocks pad less when the slots spread over many experts)."""
    return max(16, min(64, triton.next_power_of_2(max(1, num_slots // num_experts))))


def padded_bound(num_slots: int, num_experts: int, block_m: int) -> int:
    """Length of sorted_ids: every slot plus at most BLOCK_M - 1 padding per used expert,
    rounded up to whole blocks (every program loads a full block of slot ids)."""
    bound = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(sorted_ids int32 [P], expert_ids int32 [P // block_m]) for the sorted path, P =
    padded_bound: slot ids grouped by expert (in slot order within an expert), each expert's
    run starting at a multiple of block_m and padded with M; expert_ids[b] is block b's expert,
    -1 for blocks past the last run. Device ops only (no host sync), graph-capturable."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    M = flat.numel()
    P = padded_bound(M, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)                       # inclusive ends of the padded runs
    pad_start = pad_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)         # slots by expert, slot order within one
    expert = flat[order]
    rank = torch.arange(M, device=dev) - count_start[expert]
    sorted_ids = torch.full((P,), M, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pad_start[expert] + rank, order.to(torch.int32))
    block_start = torch.arange(P // block_m, device=dev) * block_m
    expert_ids = torch.searchsorted(pad_end, block_start, right=True)   # E past the last run
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


@triton.jit
def _block_rows(ids_ptr, sorted_ptr, expert_ptr, M, DECODE: tl.constexpr,
                BLOCK_M: tl.constexpr):
    # -> (expert, slot ids [BLOCK_M], valid [BLOCK_M], skip) of this program's row block
    pid = tl.program_id(0)
    if DECODE:
        slots = tl.arange(0, BLOCK_M)
        ids = tl.load(ids_ptr + slots, mask=slots < M, other=-1)
        e = tl.load(ids_ptr + pid)
        valid = ids == e
        # the first slot of expert e does its rows; later slots of e have nothing to do
        skip = tl.min(tl.where(valid, slots, BLOCK_M), axis=0) != pid
    else:
        slots = tl.load(sorted_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M))
        e = tl.load(expert_ptr + pid)
        valid = slots < M
        skip = e < 0
    return e.to(tl.int64), slots, valid, skip


@triton.jit
def _dot(a, b, acc, DOT_IEEE: tl.constexpr):
    # acc += a @ b.T; fp32 operands in ieee precision (no tf32)
    if DOT_IEEE:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _lora_rows(slot_ptr, tok, valid):
    # each row's adapter slot (-1: none, or not a row) and the lowest / highest slot >= 0
    # among them (lo > hi when there is none, so range(lo, hi + 1) is empty)
    lslot = tl.load(slot_ptr + tok, mask=valid, other=-1)
    lo = tl.min(tl.where(lslot >= 0, lslot, 1 << 30), axis=0)
    hi = tl.max(lslot, axis=0)
    return lslot, lo, hi


@triton.jit
def _lora_shrink_step(acc_s, xt, lslot, lo, hi, a_ptr, e, NE, LR, K, k0,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      DOT_IEEE: tl.constexpr):
    # acc_s [BLOCK_M, BLOCK_R] += each row's xt [BLOCK_M, BLOCK_K] (columns k0..) times its own
    # slot's A[slot, e, :, k0:].T; A [L, E, R, K] contiguous. One A tile and dot per slot
    # present: rows of other slots enter each dot as zeros.
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_r < LR)[:, None]
    if not EVEN_K:
        mask = mask & (offs_k < K)[None, :]
    for l in range(lo, hi + 1):
        rows = ((l * NE + e) * LR + offs_r).to(tl.int64)
        a = tl.load(a_ptr + rows[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        acc_s = _dot(tl.where((lslot == l)[:, None], xt, tl.zeros_like(xt)), a, acc_s, DOT_IEEE)
    return acc_s


@triton.jit
def _lora_expand(s, lslot, lo, hi, b_ptr, e, NE, N, LR, cols, col_mask,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_IEEE: tl.constexpr):
    # fp32 [BLOCK_M, BLOCK_N]: each row's shrunk s [BLOCK_M, BLOCK_R] (rounded to the dtype)
    # times its own slot's B[slot, e, cols, :].T; B [L, E, N, R] contiguous
    offs_r = tl.arange(0, s.shape[1])
    mask = col_mask[:, None] & (offs_r < LR)[None, :]
    d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for l in range(lo, hi + 1):
        rows = ((l * NE + e) * N + tl.where(col_mask, cols, 0)).to(tl.int64)
        b = tl.load(b_ptr + rows[:, None] * LR + offs_r[None, :], mask=mask, other=0.0)
        d = _dot(tl.where((lslot == l)[:, None], s, tl.zeros_like(s)), b, d, DOT_IEEE)
    return d


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, h_ptr,                 # x [T, H], w_gate_up [E, 2I, H], h [M, I]
    ids_ptr, sorted_ptr, expert_ptr,     # topk_ids [M] (decode); sorted_ids, expert_ids (sorted)
    M, TOPK, I, H, stride_xt, stride_we, stride_wn, stride_hm,
    slot_ptr, a_ptr, b_ptr, NE, LR,      # HAS_LORA: token_slots, A [L, E, R, H], B [L, E, 2I, R]
    ACTIVATION: tl.constexpr, DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_IEEE: tl.constexpr,
    HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    e, slots, valid, skip = _block_rows(ids_ptr, sorted_ptr, expert_ptr, M, DECODE, BLOCK_M)
    if skip:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    offs_k = tl.arange(0, BLOCK_K)
    tok = (slots // TOPK).to(tl.int64)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptrs = w_ptr + e * stride_we + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        lslot, lo, hi = _lora_rows(slot_ptr, tok, valid)
        acc_s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:
            x_mask, w_mask = valid[:, None], col_mask[:, None]
        else:
            k_mask = (k0 + offs_k < H)[None, :]
            x_mask, w_mask = valid[:, None] & k_mask, col_mask[:, None] & k_mask
        xt = tl.load(x_ptrs, mask=x_mask, other=0.0)
        acc_g = _dot(xt, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g, DOT_IEEE)
        acc_u = _dot(xt, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_u, DOT_IEEE)
        if HAS_LORA:
            acc_s = _lora_shrink_step(acc_s, xt, lslot, lo, hi, a_ptr, e, NE, LR, H, k0,
                                      BLOCK_R, BLOCK_K, EVEN_K, DOT_IEEE)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt)                      # gate and up rounded first
    u = acc_u.to(dt)
    if HAS_LORA:  # + the delta of the row's adapter, rounded once (0 for rows without one)
        s = acc_s.to(dt)
        g = (g.to(tl.float32) + _lora_expand(s, lslot, lo, hi, b_ptr, e, NE, 2 * I, LR, cols,
                                             col_mask, BLOCK_M, BLOCK_N, DOT_IEEE)).to(dt)
        u = (u.to(tl.float32) + _lora_expand(s, lslot, lo, hi, b_ptr, e, NE, 2 * I, LR, cols + I,
                                             col_mask, BLOCK_M, BLOCK_N, DOT_IEEE)).to(dt)
    h = _act_mul(g, u, dt, ACTIVATION)
    h_ptrs = h_ptr + slots.to(tl.int64)[:, None] * stride_hm + cols[None, :]
    tl.store(h_ptrs, h, mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, y_ptr,                 # h [M, I], w_down [E, H, I], y [M, H]
    ids_ptr, sorted_ptr, expert_ptr,
    M, TOPK, H, I, stride_hm, stride_we, stride_wn, stride_ym,
    slot_ptr, a_ptr, b_ptr, NE, LR,      # HAS_LORA: token_slots [T], A [L, E, R, I], B [L, E, H, R]
    DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_IEEE: tl.constexpr,
    HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    e, slots, valid, skip = _block_rows(ids_ptr, sorted_ptr, expert_ptr, M, DECODE, BLOCK_M)
    if skip:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < H
    offs_k = tl.arange(0, BLOCK_K)
    rows64 = slots.to(tl.int64)
    a_ptrs = h_ptr + rows64[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + cols.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if HAS_LORA:
        lslot, lo, hi = _lora_rows(slot_ptr, (slots // TOPK).to(tl.int64), valid)
        acc_s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a_mask, w_mask = valid[:, None], col_mask[:, None]
        else:
            k_mask = (k0 + offs_k < I)[None, :]
            a_mask, w_mask = valid[:, None] & k_mask, col_mask[:, None] & k_mask
        ht = tl.load(a_ptrs, mask=a_mask, other=0.0)
        acc = _dot(ht, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, DOT_IEEE)
        if HAS_LORA:
            acc_s = _lora_shrink_step(acc_s, ht, lslot, lo, hi, a_ptr, e, NE, LR, I, k0,
                                      BLOCK_R, BLOCK_K, EVEN_K, DOT_IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dt = y_ptr.dtype.element_ty
    y = acc.to(dt)
    if HAS_LORA:  # + the delta of the row's adapter, rounded once (0 for rows without one)
        y = (y.to(tl.float32) + _lora_expand(acc_s.to(dt), lslot, lo, hi, b_ptr, e, NE, H, LR,
                                             cols, col_mask, BLOCK_M, BLOCK_N, DOT_IEEE)).to(dt)
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], y,
             mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _moe_sum_kernel(
    y_ptr, wt_ptr, out_ptr,              # y [T*k, H], topk_weights [T, k] fp32, out [T, H]
    H, TOPK, stride_ym, stride_wt, stride_wk, stride_o,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOPK):
        wt = tl.load(wt_ptr + t * stride_wt + j * stride_wk)
        y = tl.load(y_ptr + (t * TOPK + j) * stride_ym + cols, mask=mask, other=0.0)
        acc += y.to(tl.float32) * wt
    tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, activation):
    check(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    check(x.dim() == 2 and w_gate_up.dim() == 3 and w_down.dim() == 3,
          f"fused_moe needs x [T, H], w_gate_up [E, 2I, H] and w_down [E, H, I], got "
          f"{tuple(x.shape)}, {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    I = two_i // 2
    check(two_i % 2 == 0 and w_gate_up.shape[2] == H and w_down.shape == (E, H, I),
          f"fused_moe needs w_gate_up [E, 2I, {H}] and w_down [E, {H}, I] of one E and I, got "
          f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    check(x.dtype in FLOAT_DTYPES and w_gate_up.dtype == x.dtype and w_down.dtype == x.dtype,
          f"fused_moe needs x and both weights in one float dtype, got {x.dtype}, "
          f"{w_gate_up.dtype} and {w_down.dtype}")
    check(x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1,
          "fused_moe needs x and the weights with contiguous rows")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == T and topk_weights.shape == topk_ids.shape,
          f"topk_ids and topk_weights must both be [{T}, k], got {tuple(topk_ids.shape)} and "
          f"{tuple(topk_weights.shape)}")
    check(topk_ids.dtype in (torch.int32, torch.int64) and topk_weights.dtype == torch.float32,
          f"topk_ids must be int32/int64 and topk_weights fp32, got {topk_ids.dtype} and "
          f"{topk_weights.dtype}")
    check(1 <= topk_ids.shape[1] <= E, f"top-k must be in [1, E = {E}], got {topk_ids.shape[1]}")
    return T, H, E, I, topk_ids.shape[1]


def fused_moe(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, activation: str = "silu", *, path: str | None = None,
              config: tuple[int, int, int, int] | None = None) -> Tensor:
    # x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], topk_weights fp32 [T, k], topk_ids int
    # [T, k] in [0, E) -> [T, H] in x's dtype: ref_fused_moe (see the module docstring).
    # path: None picks by use_decode_path; "decode" or "sorted" forces one (tests, benchmarks).
    # config: (BLOCK_N, BLOCK_K, num_stages, num_warps) of both GEMMs instead of the path's
    # DECODE_CONFIG / SORTED_CONFIG (benchmarks/fused_moe_micro.py --sweep).
    dims = _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    return _launch(x, w_gate_up, w_down, topk_weights, topk_ids, activation, dims, path, config,
                   lora=None)


def fused_moe_lora(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
                   topk_ids: Tensor, lora_a_gate_up: Tensor, lora_b_gate_up: Tensor,
                   lora_a_down: Tensor, lora_b_down: Tensor, token_slots: Tensor,
                   activation: str = "silu", *, path: str | None = None,
                   config: tuple[int, int, int, int] | None = None) -> Tensor:
    # fused_moe with expert LoRA: ref_fused_moe_lora. Adapter slots l < L hold per-expert A and
    # B (scaling folded into B), contiguous, in x's dtype: lora_a_gate_up [L, E, R, H],
    # lora_b_gate_up [L, E, 2I, R], lora_a_down [L, E, R, I], lora_b_down [L, E, H, R];
    # token_slots int [>= T]: token t's slot, -1 = no adapter (its rows get fused_moe's values).
    # The shrink x . A runs in the grouped GEMM's K loop on the x (h) tiles it already loads,
    # rounded to the dtype, and the expand in its epilogue (one A / B tile and dot per adapter
    # slot present in the row block), so a LoRA MoE step launches the same three kernels; each
    # column tile redoes its block's shrink (R rows of A against the tile's 2 * BLOCK_N
    # weight rows).
    T, H, E, I, k = dims = _check_inputs(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    check(lora_a_gate_up.dim() == 4, f"lora_a_gate_up must be [L, E, R, H], got "
          f"{tuple(lora_a_gate_up.shape)}")
    L, R = lora_a_gate_up.shape[0], lora_a_gate_up.shape[2]
    want = {"lora_a_gate_up": (L, E, R, H), "lora_b_gate_up": (L, E, 2 * I, R),
            "lora_a_down": (L, E, R, I), "lora_b_down": (L, E, H, R)}
    given = {"lora_a_gate_up": lora_a_gate_up, "lora_b_gate_up": lora_b_gate_up,
             "lora_a_down": lora_a_down, "lora_b_down": lora_b_down}
    for name, t in given.items():
        check(tuple(t.shape) == want[name] and t.dtype == x.dtype and t.is_contiguous(),
              f"{name} must be a contiguous {list(want[name])} {x.dtype} (L slots, E experts, "
              f"rank R), got {tuple(t.shape)} {t.dtype}")
    check(R >= 1 and L >= 1, f"the LoRA weights need L >= 1 slots and rank R >= 1, got {L}, {R}")
    check(token_slots.dim() == 1 and token_slots.shape[0] >= T and
          token_slots.dtype in (torch.int32, torch.int64) and token_slots.stride(0) == 1,
          f"token_slots must be a contiguous int [>= {T}], got {tuple(token_slots.shape)} "
          f"{token_slots.dtype}")
    return _launch(x, w_gate_up, w_down, topk_weights, topk_ids, activation, dims, path, config,
                   lora=(token_slots, lora_a_gate_up, lora_b_gate_up, lora_a_down, lora_b_down, R))


def _launch(x, w_gate_up, w_down, topk_weights, topk_ids, activation, dims, path, config, lora):
    T, H, E, I, k = dims
    M = T * k
    check(path in (None, "decode", "sorted"),
          f"path must be None, 'decode' or 'sorted', got {path!r}")
    decode = use_decode_path(T, k) if path is None else path == "decode"
    check(not decode or M <= DECODE_MAX_SLOTS,
          f"the decode path takes T * k <= {DECODE_MAX_SLOTS} slots, got {T} * {k}")
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    ids = topk_ids.reshape(-1)                 # slot s = t * k + j (a copy only if strided)
    h = torch.empty(M, I, dtype=x.dtype, device=x.device)
    y = torch.empty(M, H, dtype=x.dtype, device=x.device)
    if decode:
        bm = max(16, triton.next_power_of_2(M))
        sorted_ids = expert_ids = ids              # unread by the decode kernels
        grid_m = M
        bn, bk, stages, warps = DECODE_CONFIG
    else:
        bm = sorted_block_m(M, E)
        sorted_ids, expert_ids = moe_align(topk_ids, E, bm)
        grid_m = expert_ids.shape[0]
        bn, bk, stages, warps = SORTED_CONFIG
    if config is not None:
        bn, bk, stages, warps = config
    ieee = x.dtype == torch.float32
    if ieee and config is None:
        stages = min(stages, 2)                    # fp32 tiles take twice the shared memory
    if lora is None:
        lora_gu = lora_d = (x, x, x, 0, 0)         # unread: HAS_LORA=False
        block_r = 16
    else:
        slots, a_gu, b_gu, a_d, b_d, R = lora
        lora_gu, lora_d = (slots, a_gu, b_gu, E, R), (slots, a_d, b_d, E, R)
        block_r = max(16, triton.next_power_of_2(R))   # tl.dot's minimum K is 16
    pdl = pdl_kwargs(x)
    common = dict(DECODE=decode, BLOCK_M=bm, DOT_IEEE=ieee, HAS_LORA=lora is not None,
                  BLOCK_R=block_r, num_stages=stages, num_warps=warps, **pdl)
    bn_i = max(16, min(bn, triton.next_power_of_2(I)))
    bk_h = max(16, min(bk, triton.next_power_of_2(H)))
    _moe_gate_up_kernel[(grid_m, triton.cdiv(I, bn_i))](
        x, w_gate_up, h, ids, sorted_ids, expert_ids, M, k, I, H, x.stride(0),
        w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0), *lora_gu, ACTIVATION=activation,
        BLOCK_N=bn_i, BLOCK_K=bk_h, EVEN_K=H % bk_h == 0, **common)
    bn_h = max(16, min(bn, triton.next_power_of_2(H)))
    bk_i = max(16, min(bk, triton.next_power_of_2(I)))
    _moe_down_kernel[(grid_m, triton.cdiv(H, bn_h))](
        h, w_down, y, ids, sorted_ids, expert_ids, M, k, H, I, h.stride(0), w_down.stride(0),
        w_down.stride(1), y.stride(0), *lora_d, BLOCK_N=bn_h, BLOCK_K=bk_i,
        EVEN_K=I % bk_i == 0, **common)
    block = min(1024, triton.next_power_of_2(H))
    _moe_sum_kernel[(T, triton.cdiv(H, block))](
        y, topk_weights, out, H, k, y.stride(0), topk_weights.stride(0), topk_weights.stride(1),
        out.stride(0), BLOCK=block, num_warps=4, **pdl)
    return out
