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
One program handles BLOCK_H heads of one token; program_id(1) walks q's head blocks, then k's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.utils import FLOAT_DTYPES, check


@triton.jit
def _rope_heads(x_ptr, stride_t, stride_h, t, h0, H, c, s, offs_h, offs_d, d_mask,
                HALF: tl.constexpr):
    heads = h0 + offs_h
    mask = (heads < H)[:, None] & d_mask[None, :]
    p1 = x_ptr + t * stride_t + heads[:, None].to(tl.int64) * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    c = c.to(dt).to(tl.float32)[None, :]
    s = s.to(dt).to(tl.float32)[None, :]
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    o1 = (a1 * c).to(dt).to(tl.float32) + (-a2 * s).to(dt).to(tl.float32)
    o2 = (a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p1 + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,            # [T, Hq, D]   rotated in place
    k_ptr,            # [T, Hkv, D]  rotated in place
    cs_ptr,           # fp32 [P, D]  cat(cos, sin)
    pos_ptr,          # int [T]
    Hq, Hkv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    Q_BLOCKS,         # cdiv(Hq, BLOCK_H): head blocks of q come first on axis 1
    HALF: tl.constexpr,       # D / 2
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
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
                    offs_h, offs_d, d_mask, HALF)
    else:
        _rope_heads(k_ptr, stride_kt, stride_kh, t, (hb - Q_BLOCKS) * BLOCK_H, Hkv, c, s,
                    offs_h, offs_d, d_mask, HALF)


def apply_rotary(q: Tensor, k: Tensor, cos_sin: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    # q: [T, Hq, D], k: [T, Hkv, D] (head dim contiguous, any token/head strides),
    # cos_sin: fp32 [P, D], positions: int [T] (each < P, not checked: no host sync).
    # Rotates q and k in place and returns them.
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
    if T == 0:
        return q, k
    block_half = triton.next_power_of_2(D // 2)
    block_h = max(1, min(triton.next_power_of_2(max(Hq, Hkv)), 512 // block_half))
    q_blocks = triton.cdiv(Hq, block_h)
    grid = (T, q_blocks + triton.cdiv(Hkv, block_h))
    _rotary_kernel[grid](
        q, k, cos_sin, positions, Hq, Hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.stride(0), q_blocks,
        HALF=D // 2, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4)
    return q, k
