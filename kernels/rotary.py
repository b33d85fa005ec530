"""Rotary position embedding (HF "rotate_half" layout) applied in place to q and k, one kernel.

q [T, Hq, D] and k [T, Hkv, D] are usually views into the fused qkv projection output, so
their token stride is q_size + 2*kv_size, not H*D: the kernel takes both strides (the head
dim must be contiguous). cos_sin is the fp32 cache [max_pos, R] = cat(cos, sin) of the R/2
frequencies, indexed by `positions` in-kernel (no host sync, static grid: graph capturable).

Partial rotary (Phi-3/Phi-4-mini's partial_rotary_factor, Phi-2): R, the table's width, is the
rotary dim (even, <= D). Dims 0..R-1 rotate as pairs (i, i + R/2), dims R..D-1 pass through
unchanged, as in transformers' apply_rotary_pos_emb. Both kernels work on D/2 columns per head:
column i < R/2 is the rotary pair (i, i + R/2); past those, column R/2 + i holds the pass-through
pair (R + i, R + (D-R)/2 + i). So one tile covers the whole head, and the block sizes are those of
R == D. R is a constexpr (HALF = R/2, PASS_HALF = (D-R)/2): with PASS_HALF == 0 the pass-through
code is not compiled and the kernels are the full-rotary ones. Where the head is rewritten in
place without a delta, the pass-through dims are neither read nor written.

Rounding follows HF's `q * cos + rotate_half(q) * sin` in q's dtype (see ref_rotary): cos/sin
are rounded to q's dtype, each product is rounded, then the sum is rounded. A product (or sum)
of two bf16/fp16 values is exact in fp32, so computing each step in fp32 and rounding it to the
dtype reproduces torch's bf16/fp16 ops exactly. For x = [x1, x2] (halves):
  out1 = rnd(rnd(x1*c) + rnd(-x2*s)),  out2 = rnd(rnd(x2*c) + rnd(x1*s))
One program handles BLOCK_H heads of one token; program_id(1) walks q's head blocks, then k's.

With a LoRA delta of the qkv projection a second kernel runs instead, on tiles of token rows x
heads (kernels/lora_delta.py): program_id(1) walks q's, k's, then v's head blocks, the delta is
added to all D dims of q, k (before rotating) and v, each rounded once. The no-LoRA kernel is
the plain one.

With `kv_cache` (apply_rotary_into_cache) both kernels also write this step's K/V into the
paged cache: rotated k (its pass-through dims copied) and v (plus their deltas) go straight
to their cache slots, flat slot `slot_mapping[t]` of k_cache / v_cache [num_blocks, block_size,
Hkv, D], instead of back into the qkv output. This replaces the two index_copy launches per layer that wrote the cache
after the rotary (64 launches of a Llama-2-7b decode step); q is still rotated in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_delta import (delta_args, gather_consts, lora_delta_rows,
                                        lora_delta_tile, row_block, tile_shrunk, tile_slots)
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.pdl import pdl_enter, pdl_kwargs
from batchrun.kernels.utils import FLOAT_DTYPES, check


@triton.jit
def _rotate(x1, x2, c, s):
    # HF's rounding (module docstring): c, s are fp32, x1, x2 the halves in the model dtype
    dt = x1.dtype
    c = c.to(dt).to(tl.float32)
    s = s.to(dt).to(tl.float32)
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    o1 = ((a1 * c).to(dt).to(tl.float32) + (-a2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def _pass_pairs(jd, HALF: tl.constexpr, PASS_HALF: tl.constexpr):
    # (first dim, distance to the second) of each column jd when R < D (module docstring):
    # the rotary pair (jd, jd + HALF) for jd < HALF, else the pass-through pair from R on
    rot = jd < HALF
    return tl.where(rot, jd, jd + HALF), tl.where(rot, HALF, PASS_HALF)


@triton.jit
def _keep_pass(x1, x2, r1, r2, jd, HALF: tl.constexpr):
    # the rotated pair (r1, r2) in the rotary columns, x1, x2 as they were in the pass-through
    # ones (their cos/sin lanes are masked: what _rotate made of them is not the identity)
    keep = (jd >= HALF)[None, :]
    return tl.where(keep, x1, r1), tl.where(keep, x2, r2)


@triton.jit
def _rope_heads(x_ptr, stride_t, stride_h, t, h0, H, c, s, offs_h, offs_d, d_mask,
                dst_ptr, dst_stride_h, HALF: tl.constexpr, PASS_HALF: tl.constexpr,
                ROTATE: tl.constexpr, inv_scale=1.0, QUANT: tl.constexpr = False):
    # heads h0.. of token t, columns offs_d where d_mask: x (rotated when ROTATE) to
    # dst_ptr + head * dst_stride_h, which is x's own row (in place) or the token's cache slot
    if PASS_HALF == 0:
        o1 = offs_d
        step = HALF
    else:
        o1, step = _pass_pairs(offs_d, HALF, PASS_HALF)
        step = step[None, :]
    heads = h0 + offs_h
    mask = (heads < H)[:, None] & d_mask[None, :]
    heads64 = heads[:, None].to(tl.int64)
    p1 = x_ptr + t * stride_t + heads64 * stride_h + o1[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + step, mask=mask, other=0.0)
    if ROTATE:
        r1, r2 = _rotate(x1, x2, c[None, :], s[None, :])
        if PASS_HALF == 0:
            x1, x2 = r1, r2
        else:
            x1, x2 = _keep_pass(x1, x2, r1, r2, offs_d, HALF)
    d1 = dst_ptr + heads64 * dst_stride_h + o1[None, :]
    if QUANT:  # an e4m3 cache: value / scale, saturated
        x1, x2 = _to_fp8(x1, inv_scale), _to_fp8(x2, inv_scale)
    tl.store(d1, x1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(d1 + step, x2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _to_fp8(x, inv_scale):
    return tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0)


@triton.jit
def _rotary_kernel(
    q_ptr,            # [T, Hq, D]   rotated in place
    k_ptr,            # [T, Hkv, D]  rotated in place, or into k_cache (TO_CACHE)
    v_ptr,            # [T, Hkv, D]  copied into v_cache (TO_CACHE only)
    kc_ptr, vc_ptr,   # caches [num_blocks * block_size, Hkv, D] (TO_CACHE only)
    slot_ptr,         # int64 [T]: each token's flat cache slot (TO_CACHE only)
    cs_ptr,           # fp32 [P, R]  cat(cos, sin)
    pos_ptr,          # int [T]
    Hq, Hkv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cslot, stride_ch,   # cache strides of a slot and a head
    Q_BLOCKS,         # cdiv(Hq, BLOCK_H): head blocks of q come first on axis 1, then k (then v)
    KV_BLOCKS,        # cdiv(Hkv, BLOCK_H)
    k_inv, v_inv,     # 1 / the e4m3 cache's k and v scales (QUANT only)
    HALF: tl.constexpr,       # R / 2
    PASS_HALF: tl.constexpr,  # (D - R) / 2
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, TO_CACHE: tl.constexpr,
    QUANT: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF                   # the rotary columns
    all_mask = offs_d < HALF + PASS_HALF     # and the pass-through ones (copied to the cache)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)
    s = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0)
    if hb < Q_BLOCKS:
        _rope_heads(q_ptr, stride_qt, stride_qh, t, hb * BLOCK_H, Hq, c, s,
                    offs_h, offs_d, d_mask, q_ptr + t * stride_qt, stride_qh, HALF, PASS_HALF,
                    True)
    elif TO_CACHE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if hb < Q_BLOCKS + KV_BLOCKS:
            _rope_heads(k_ptr, stride_kt, stride_kh, t, (hb - Q_BLOCKS) * BLOCK_H, Hkv, c, s,
                        offs_h, offs_d, all_mask, kc_ptr + slot * stride_cslot, stride_ch,
                        HALF, PASS_HALF, True, k_inv, QUANT)
        else:
            _rope_heads(v_ptr, stride_vt, stride_vh, t, (hb - Q_BLOCKS - KV_BLOCKS) * BLOCK_H,
                        Hkv, c, s, offs_h, offs_d, all_mask, vc_ptr + slot * stride_cslot,
                        stride_ch, HALF, PASS_HALF, False, v_inv, QUANT)
    else:
        _rope_heads(k_ptr, stride_kt, stride_kh, t, (hb - Q_BLOCKS) * BLOCK_H, Hkv, c, s,
                    offs_h, offs_d, d_mask, k_ptr + t * stride_kt, stride_kh, HALF, PASS_HALF,
                    True)


@triton.jit
def _rope_lora_tile(x_ptr, stride_t, stride_h, rows, row_mask, h0, H, jh, jd, jd_mask,
                    cs_ptr, pos_ptr, stride_cs,
                    s_ptr, stride_s, b_ptr, slot, lo, hi, LN, LS, LR, slice_idx, col0,
                    dst_ptr, dst_rows, dst_stride_t, dst_stride_h,
                    HALF: tl.constexpr, PASS_HALF: tl.constexpr, ROTATE: tl.constexpr,
                    BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr,
                    GATHER: tl.constexpr, R_CHUNK: tl.constexpr, inv_scale=1.0,
                    QUANT: tl.constexpr = False):
    # Tile: BLOCK_M rows x (BLOCK_H heads x BLOCK_HALF columns) flattened into BLOCK_N columns;
    # column j is column jd[j] of head h0 + jh[j]: its pair of dims (jd, jd + HALF), or past
    # HALF a pass-through pair (module docstring). jd_mask: jd < D/2, every dim gets its delta.
    # The result goes to dst_ptr + dst_rows * dst_stride_t + head * dst_stride_h: x's own rows
    # (in place) or the rows' cache slots.
    if PASS_HALF == 0:
        o1 = jd
        step = HALF
    else:
        o1, step = _pass_pairs(jd, HALF, PASS_HALF)
    heads = h0 + jh
    col_mask = (heads < H) & jd_mask
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    p1 = x_ptr + rows64[:, None] * stride_t + (heads.to(tl.int64) * stride_h + o1)[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + step, mask=mask, other=0.0)
    dt = x1.dtype
    # head h of the slice: columns h*D .. h*D + D
    cols = col0 + heads * (2 * (HALF + PASS_HALF)) + o1
    if GATHER:
        d1, d2 = lora_delta_rows(s_ptr, stride_s, b_ptr, rows, slot, slice_idx, slice_idx, cols,
                                 cols + step, col_mask, LN, LS, LR, BLOCK_M, BLOCK_N, BLOCK_R,
                                 R_CHUNK, PAIR=True)
    else:
        s_own = tile_shrunk(s_ptr, stride_s, rows, slot, slice_idx, LS, LR, BLOCK_R, DOT_IEEE)
        d1, d2 = lora_delta_tile(s_own, s_own, b_ptr, slot, lo, hi, cols, cols + step, col_mask,
                                 LN, LR, BLOCK_M, BLOCK_N, BLOCK_R, DOT_IEEE, PAIR=True)
    x1 = (x1.to(tl.float32) + d1).to(dt)
    x2 = (x2.to(tl.float32) + d2).to(dt)
    if ROTATE:
        pos = tl.load(pos_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        cs = cs_ptr + pos[:, None] * stride_cs + jd[None, :]
        cs_mask = row_mask[:, None] & (jd < HALF)[None, :]
        c = tl.load(cs, mask=cs_mask, other=0.0)
        s = tl.load(cs + HALF, mask=cs_mask, other=0.0)
        r1, r2 = _rotate(x1, x2, c, s)
        if PASS_HALF == 0:
            x1, x2 = r1, r2
        else:
            x1, x2 = _keep_pass(x1, x2, r1, r2, jd, HALF)
    d = dst_ptr + dst_rows[:, None] * dst_stride_t + (heads.to(tl.int64) * dst_stride_h + o1)[None, :]
    if QUANT:  # an e4m3 cache: value / scale, saturated
        x1, x2 = _to_fp8(x1, inv_scale), _to_fp8(x2, inv_scale)
    tl.store(d, x1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(d + step, x2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_lora_kernel(
    q_ptr, k_ptr,     # as in _rotary_kernel
    v_ptr,            # [T, Hkv, D]  LoRA delta added in place, or into v_cache (TO_CACHE)
    kc_ptr, vc_ptr, slot_map_ptr,   # as in _rotary_kernel (TO_CACHE only)
    cs_ptr, pos_ptr, T, Hq, Hkv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_cslot, stride_ch,
    Q_BLOCKS, K_BLOCKS,   # head blocks of q, then k, then v on axis 1
    s_ptr, stride_s, b_ptr, slot_ptr, LN, LS, LR,   # LoRA delta of q|k|v
    OFF_K, OFF_V,     # first fused-output column of k and of v
    k_inv, v_inv,     # 1 / the e4m3 cache's k and v scales (QUANT only)
    HALF: tl.constexpr, PASS_HALF: tl.constexpr,   # R / 2, (D - R) / 2
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_N: tl.constexpr,    # BLOCK_H * BLOCK_HALF
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr,
    GATHER: tl.constexpr, R_CHUNK: tl.constexpr, TO_CACHE: tl.constexpr,
    QUANT: tl.constexpr, PDL: tl.constexpr,
):
    pdl_enter(PDL)
    # Grid (row tiles, head blocks of q | k | v): B[the block's columns] is read once per
    # slot the tile's rows use.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    hb = tl.program_id(1)
    j = tl.arange(0, BLOCK_N)
    jh, jd = j // BLOCK_HALF, j % BLOCK_HALF
    jd_mask = jd < HALF + PASS_HALF
    slot, lo, hi = tile_slots(slot_ptr, rows, row_mask)
    if hb < Q_BLOCKS:
        _rope_lora_tile(q_ptr, stride_qt, stride_qh, rows, row_mask, hb * BLOCK_H, Hq, jh, jd,
                        jd_mask, cs_ptr, pos_ptr, stride_cs, s_ptr, stride_s, b_ptr, slot, lo, hi,
                        LN, LS, LR, 0, 0, q_ptr, rows64, stride_qt, stride_qh,
                        HALF, PASS_HALF, True, BLOCK_M, BLOCK_N, BLOCK_R, DOT_IEEE, GATHER,
                        R_CHUNK)
    else:
        if TO_CACHE:
            kd_ptr, vd_ptr = kc_ptr, vc_ptr
            dst_rows = tl.load(slot_map_ptr + rows, mask=row_mask, other=0).to(tl.int64)
            kd_t, kd_h, vd_t, vd_h = stride_cslot, stride_ch, stride_cslot, stride_ch
        else:
            kd_ptr, vd_ptr, dst_rows = k_ptr, v_ptr, rows64
            kd_t, kd_h, vd_t, vd_h = stride_kt, stride_kh, stride_vt, stride_vh
        if hb < Q_BLOCKS + K_BLOCKS:
            _rope_lora_tile(k_ptr, stride_kt, stride_kh, rows, row_mask,
                            (hb - Q_BLOCKS) * BLOCK_H, Hkv, jh, jd, jd_mask, cs_ptr, pos_ptr,
                            stride_cs, s_ptr, stride_s, b_ptr, slot, lo, hi, LN, LS, LR, 1, OFF_K,
                            kd_ptr, dst_rows, kd_t, kd_h, HALF, PASS_HALF, True, BLOCK_M,
                            BLOCK_N, BLOCK_R, DOT_IEEE, GATHER, R_CHUNK, k_inv, QUANT)
        else:  # v: only the LoRA delta
            _rope_lora_tile(v_ptr, stride_vt, stride_vh, rows, row_mask,
                            (hb - Q_BLOCKS - K_BLOCKS) * BLOCK_H, Hkv, jh, jd, jd_mask, cs_ptr,
                            pos_ptr, stride_cs, s_ptr, stride_s, b_ptr, slot, lo, hi, LN, LS, LR,
                            2, OFF_V, vd_ptr, dst_rows, vd_t, vd_h, HALF, PASS_HALF, False,
                            BLOCK_M, BLOCK_N, BLOCK_R, DOT_IEEE, GATHER, R_CHUNK, v_inv, QUANT)


def apply_rotary(q: Tensor, k: Tensor, cos_sin: Tensor, positions: Tensor,
                 v: Tensor | None = None, lora: LoRADelta | None = None) -> tuple[Tensor, Tensor]:
    # q: [T, Hq, D], k: [T, Hkv, D] (head dim contiguous, any token/head strides),
    # cos_sin: fp32 [P, R], R = the rotary dim (even, <= D), positions: int [T] (each < P, not
    # checked: no host sync). Rotates dims 0..R-1 of q and k in place (R..D-1 pass through) and
    # returns them.
    # lora: the qkv projection's LoRA delta (slices q, k, v; head h of a slice is its columns
    # h*D..h*D+D): it is added to q, k (before rotating) and to v [T, Hkv, D], all in place.
    _launch(q, k, v, cos_sin, positions, lora, None)
    return q, k


def apply_rotary_into_cache(q: Tensor, k: Tensor, v: Tensor, cos_sin: Tensor, positions: Tensor,
                            k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                            lora: LoRADelta | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> Tensor:
    # As apply_rotary, but rotated k and v (each plus its LoRA delta) are written to the paged
    # caches [num_blocks, block_size, Hkv, D] at flat slot slot_mapping[t] (int64 [T], each a
    # valid slot: not checked, no host sync), not back into k and v, which are left as they
    # were. Returns q, rotated in place. An e4m3 cache gets k / k_scale and v / v_scale,
    # saturated at +-448.
    _launch(q, k, v, cos_sin, positions, lora, (k_cache, v_cache, slot_mapping),
            (1.0 / k_scale, 1.0 / v_scale))
    return q


def _launch(q, k, v, cos_sin, positions, lora, cache, inv_scales=(1.0, 1.0)) -> None:
    check(q.dim() == 3 and k.dim() == 3, "q and k must be [T, H, D]")
    T, Hq, D = q.shape
    check(k.shape[0] == T and k.shape[2] == D, f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(D % 2 == 0, f"head dim must be even, got {D}")
    check(q.dtype in FLOAT_DTYPES and k.dtype == q.dtype, "q and k must share a float dtype")
    check(q.stride(2) == 1 and k.stride(2) == 1, "head dim of q and k must be contiguous")
    check(cos_sin.dim() == 2 and cos_sin.stride(1) == 1 and cos_sin.dtype == torch.float32,
          "cos_sin must be fp32 [P, R] with a contiguous last dim")
    R = cos_sin.shape[1]   # the rotary dim
    check(0 < R <= D and R % 2 == 0,
          f"cos_sin's width (the rotary dim) must be even and in 2..{D}, got {R}")
    check(positions.shape == (T,) and not positions.is_floating_point(), "positions must be int [T]")
    Hkv = k.shape[1]
    if lora is not None or cache is not None:
        check(v is not None and v.shape == k.shape and v.dtype == q.dtype and v.stride(2) == 1,
              f"{'a LoRA delta' if lora is not None else 'writing the KV cache'} needs v shaped "
              f"like k {tuple(k.shape)} with a contiguous head dim")
    if lora is not None:
        want = (0, Hq * D, (Hq + Hkv) * D, (Hq + 2 * Hkv) * D)
        check(tuple(lora.slice_offsets) == want,
              f"LoRA slice offsets {tuple(lora.slice_offsets)} are not q|k|v's {want}")
        largs, consts = delta_args(lora, T, (Hq + 2 * Hkv) * D, 3, q.device)
    if cache is not None:
        kc, vc, slots = cache
        check(kc.dim() == 4 and vc.shape == kc.shape and kc.shape[2:] == (Hkv, D)
              and kc.dtype == vc.dtype and kc.dtype in (q.dtype, torch.float8_e4m3fn),
              f"k/v caches must be [num_blocks, block_size, {Hkv}, {D}] of {q.dtype} or e4m3, got "
              f"{tuple(kc.shape)} {kc.dtype}, {tuple(vc.shape)} {vc.dtype}")
        check(kc.stride() == vc.stride() and kc.stride(3) == 1 and kc.stride(2) == D
              and kc.stride(0) == kc.shape[1] * kc.stride(1),
              "k/v caches must be contiguous within a block and share strides")
        check(slots.shape == (T,) and not slots.is_floating_point(), "slot_mapping must be int [T]")
        stride_cslot, stride_ch = kc.stride(1), kc.stride(2)
    else:  # unused pointers (TO_CACHE is off): any tensors
        v = q if v is None else v
        kc, vc, slots, stride_cslot, stride_ch = q, q, positions, 0, 0
    quant = kc.dtype == torch.float8_e4m3fn
    if T == 0:
        return
    block_half = triton.next_power_of_2(D // 2)
    if lora is None:
        block_h = max(1, min(triton.next_power_of_2(max(Hq, Hkv)), 512 // block_half))
        q_blocks, kv_blocks = triton.cdiv(Hq, block_h), triton.cdiv(Hkv, block_h)
        grid = (T, q_blocks + kv_blocks * (1 if cache is None else 2))
        _rotary_kernel[grid](
            q, k, v, kc, vc, slots, cos_sin, positions, Hq, Hkv, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
            stride_cslot, stride_ch, q_blocks, kv_blocks, *inv_scales,
            HALF=R // 2, PASS_HALF=(D - R) // 2, BLOCK_H=block_h, BLOCK_HALF=block_half,
            TO_CACHE=cache is not None, QUANT=quant,
            num_warps=4, **pdl_kwargs(q))
        return
    # About 64 columns (half-head dims) per tile: one head of D = 128, and enough programs
    # (row tiles x 3 slices' heads) to fill the GPU at decode sizes. At least 16 (tl.dot).
    block_h = max(1, min(triton.next_power_of_2(max(Hq, Hkv)), 64 // block_half))
    block_h = max(block_h, triton.cdiv(16, block_half))
    bm = row_block(T)
    q_blocks, k_blocks = triton.cdiv(Hq, block_h), triton.cdiv(Hkv, block_h)
    _rotary_lora_kernel[(triton.cdiv(T, bm), q_blocks + 2 * k_blocks)](
        q, k, v, kc, vc, slots, cos_sin, positions, T, Hq, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0), stride_cslot, stride_ch, q_blocks, k_blocks, *largs,
        Hq * D, (Hq + Hkv) * D, *inv_scales,
        HALF=R // 2, PASS_HALF=(D - R) // 2, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_N=block_h * block_half,
        BLOCK_M=bm, TO_CACHE=cache is not None, QUANT=quant, **consts,
        **gather_consts(T, bm, block_h * block_half, consts["BLOCK_R"], pairs=2),
        num_warps=4, num_stages=1, **pdl_kwargs(q))
