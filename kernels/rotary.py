"""Rotary position embedding (HF "rotate_half" layout) applied in place to q and k, one kernel.

q [T, Hq, D] and k [T, Hkv, D] are usually views into the fused qkv projection output, so
their token stride is q_size + 2*kv_size, not H*D: the kernel takes both strides (the head
dim must be contiguous). cos_sin is the fp32 cache [max_pos, D] = cat(cos, sin) of the D/2
frequencies, indexed by `positions` in-kernel (no host sync, static grid: graph capturable).

Rounding follows HF's `q * cos + rotate_half(q) * sin` in q's dtype (see ref_rotary): cos/sin
are rounded to q's dtype, each product is rounded, then the sum is rounded. A product (or sum)
of two bf16/fp16 values is exact in fp32, so computing each step in fp32 and rounding it to the
dtype reproduces torch's bf16/fp16 ops exactly. For x = [x1, x2] (halves):
  out1 = rnd(rnd(x1*c) + rnd(-x2*s)),  out2 = rnd(rnd(x2*c) + rnd(x1*s))
One program handles BLOCK_H heads of one token; program_id(1) walks q's head blocks, then k's
(then v's, when a LoRA delta is fused in: see apply_rotary).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_delta import delta_args, lora_delta, r_chunk
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.utils import FLOAT_DTYPES, check


@triton.jit
def _rope_heads(x_ptr, stride_t, stride_h, t, h0, H, c, s, offs_h, offs_d, d_mask,
                s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR, slice_idx, col0,
                HALF: tl.constexpr, ROTATE: tl.constexpr, HAS_LORA: tl.constexpr,
                BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr):
    heads = h0 + offs_h
    mask = (heads < H)[:, None] & d_mask[None, :]
    p1 = x_ptr + t * stride_t + heads[:, None].to(tl.int64) * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    if HAS_LORA:  # head h of this slice is fused-output columns col0 + h*D .. col0 + h*D + D
        cols = col0 + heads[:, None] * (2 * HALF) + offs_d[None, :]
        d1 = lora_delta(s_ptr, stride_s, b_ptr, slot_ptr, t, slice_idx, cols, mask,
                        LN, LL, LR, BLOCK_R, R_CHUNK)
        d2 = lora_delta(s_ptr, stride_s, b_ptr, slot_ptr, t, slice_idx, cols + HALF, mask,
                        LN, LL, LR, BLOCK_R, R_CHUNK)
        x1 = (x1.to(tl.float32) + d1).to(dt)
        x2 = (x2.to(tl.float32) + d2).to(dt)
    if ROTATE:
        c = c.to(dt).to(tl.float32)[None, :]
        s = s.to(dt).to(tl.float32)[None, :]
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        o1 = ((a1 * c).to(dt).to(tl.float32) + (-a2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    else:  # v: only the LoRA delta
        o1 = x1
        o2 = x2
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,            # [T, Hq, D]   rotated in place
    k_ptr,            # [T, Hkv, D]  rotated in place
    v_ptr,            # [T, Hkv, D]  LoRA delta added in place (HAS_LORA only)
    cs_ptr,           # fp32 [P, D]  cat(cos, sin)
    pos_ptr,          # int [T]
    Hq, Hkv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    Q_BLOCKS,         # cdiv(Hq, BLOCK_H): head blocks of q come first on axis 1, then k, then v
    K_BLOCKS,         # cdiv(Hkv, BLOCK_H)
    s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR,   # LoRA delta of q|k|v (HAS_LORA only)
    OFF_K, OFF_V,     # first fused-output column of k and of v (LoRA only)
    HALF: tl.constexpr,       # D / 2
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cs_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)
    s = tl.load(cs_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0)
    if hb < Q_BLOCKS:
        _rope_heads(q_ptr, stride_qt, stride_qh, t, hb * BLOCK_H, Hq, c, s,
                    offs_h, offs_d, d_mask, s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR, 0, 0,
                    HALF, True, HAS_LORA, BLOCK_R, R_CHUNK)
    elif hb < Q_BLOCKS + K_BLOCKS:
        _rope_heads(k_ptr, stride_kt, stride_kh, t, (hb - Q_BLOCKS) * BLOCK_H, Hkv, c, s,
                    offs_h, offs_d, d_mask, s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR,
                    1, OFF_K, HALF, True, HAS_LORA, BLOCK_R, R_CHUNK)
    elif HAS_LORA:
        _rope_heads(v_ptr, stride_vt, stride_vh, t, (hb - Q_BLOCKS - K_BLOCKS) * BLOCK_H, Hkv,
                    c, s, offs_h, offs_d, d_mask, s_ptr, stride_s, b_ptr, slot_ptr, LN, LL, LR,
                    2, OFF_V, HALF, False, HAS_LORA, BLOCK_R, R_CHUNK)


def apply_rotary(q: Tensor, k: Tensor, cos_sin: Tensor, positions: Tensor,
                 v: Tensor | None = None, lora: LoRADelta | None = None) -> tuple[Tensor, Tensor]:
    # q: [T, Hq, D], k: [T, Hkv, D] (head dim contiguous, any token/head strides),
    # cos_sin: fp32 [P, D], positions: int [T] (each < P, not checked: no host sync).
    # Rotates q and k in place and returns them.
    # lora: the qkv projection's LoRA delta (slices q, k, v; head h of a slice is its columns
    # h*D..h*D+D): it is added to q, k (before rotating) and to v [T, Hkv, D], all in place.
    check(q.dim() == 3 and k.dim() == 3, "q and k must be [T, H, D]")
    T, Hq, D = q.shape
    check(k.shape[0] == T and k.shape[2] == D, f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(D % 2 == 0, f"head dim must be even, got {D}")
    check(q.dtype in FLOAT_DTYPES and k.dtype == q.dtype, "q and k must share a float dtype")
    check(q.stride(2) == 1 and k.stride(2) == 1, "head dim of q and k must be contiguous")
    check(cos_sin.dim() == 2 and cos_sin.shape[1] == D and cos_sin.stride(1) == 1
          and cos_sin.dtype == torch.float32, f"cos_sin must be fp32 [P, {D}]")
    check(positions.shape == (T,) and not positions.is_floating_point(), "positions must be int [T]")
    Hkv = k.shape[1]
    if lora is not None:
        check(v is not None and v.shape == k.shape and v.dtype == q.dtype and v.stride(2) == 1,
              f"a LoRA delta needs v shaped like k {tuple(k.shape)} with a contiguous head dim")
        want = (0, Hq * D, (Hq + Hkv) * D, (Hq + 2 * Hkv) * D)
        check(tuple(lora.slice_offsets) == want,
              f"LoRA slice offsets {tuple(lora.slice_offsets)} are not q|k|v's {want}")
    vv = v if lora is not None else k
    if T == 0:
        return q, k
    largs, block_r = delta_args(lora, q, T, (Hq + 2 * Hkv) * D, 3)
    block_half = triton.next_power_of_2(D // 2)
    # With a LoRA delta each head also needs a [D, R] slice of B: 2 heads per program spread
    # those loads over many programs (a decode step has only a few tokens).
    max_h = 512 // block_half if lora is None else max(1, 128 // block_half)
    block_h = max(1, min(triton.next_power_of_2(max(Hq, Hkv)), max_h))
    q_blocks, k_blocks = triton.cdiv(Hq, block_h), triton.cdiv(Hkv, block_h)
    grid = (T, q_blocks + k_blocks * (2 if lora is not None else 1))
    _rotary_kernel[grid](
        q, k, vv, cos_sin, positions, Hq, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        cos_sin.stride(0), q_blocks, k_blocks, *largs, Hq * D, (Hq + Hkv) * D,
        HALF=D // 2, BLOCK_H=block_h, BLOCK_HALF=block_half,
        HAS_LORA=lora is not None, BLOCK_R=block_r,
        R_CHUNK=r_chunk(block_r, block_h * block_half), num_warps=4)
    return q, k
