"""LoRA shrink (Punica SGMV): out[s, t, :] = x[t] @ lora_a[s, slot[t]].T, grouped by slot.

Grid = (m-blocks x rank-blocks, slices, max_loras + 1): it depends only on static shapes, so the
launch can be captured in a CUDA graph and replayed after `LoRAKernelMeta.prepare` rewrites the
metadata. Each program handles one block of one slot's tokens (gathered through
sorted_token_ids) and loops over all of K, so every output row is written by exactly one program
with a plain store: no pre-zeroing, no atomics, and rows of slot -1 tokens are never touched.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.utils import FLOAT_DTYPES, check, dot_block


@triton.jit
def _lora_shrink_kernel(
    # pointers
    x_ptr,            # [T, K]
    a_ptr,            # [S, L, R, K]
    out_ptr,          # [S, T_max, R] fp32
    sorted_ids_ptr,   # int32 [max_tokens]
    active_ptr,       # int32 [L + 1]
    count_ptr,        # int32 [L + 1]
    start_ptr,        # int32 [L + 1]
    # sizes
    K, R,
    # strides (last dims are contiguous)
    stride_xt,
    stride_as, stride_al, stride_ar,
    stride_os, stride_ot,
    # constexprs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    entry = tl.program_id(2)
    num_n = tl.cdiv(R, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n

    slot = tl.load(active_ptr + entry)
    if slot < 0:
        return
    count = tl.load(count_ptr + entry)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(start_ptr + entry)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tok = tl.load(sorted_ids_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < R
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]                    # [BM, BK]
    a_base = a_ptr + s.to(tl.int64) * stride_as + slot.to(tl.int64) * stride_al
    a_ptrs = a_base + offs_n[None, :] * stride_ar + offs_k[:, None]                # [BK, BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        # "ieee": exact fp32 products for fp32 inputs (no tf32); no effect for 16-bit inputs.
        acc = tl.dot(xt, at, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K

    out_ptrs = out_ptr + s.to(tl.int64) * stride_os + tok[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


def _config(T: int, R: int, K: int, elem_bytes: int) -> tuple[int, int, int, int, int]:
    # Decode (small T) is memory-bound and short of programs: small M-blocks give more programs
    # in flight; wide K-tiles with several stages keep enough bytes in flight per SM.
    block_m = 16 if T <= 128 else 32 if T <= 1024 else 64
    block_n = dot_block(R, 64)
    block_k = (512 if block_m == 16 else 256) // elem_bytes
    block_k = min(block_k, dot_block(K, 256))
    # Stages as deep as ~160 KB of shared memory allows (H100/H200 have 227 KB per SM).
    stage_bytes = (block_m + block_n) * block_k * elem_bytes
    num_stages = max(2, min(4, (160 * 1024) // stage_bytes))
    return block_m, block_n, block_k, 4, num_stages


def lora_shrink(x: Tensor, lora_a: Tensor, out: Tensor, meta: LoRAKernelMeta) -> None:
    # x:      [T, K]         fp16/bf16/fp32, contiguous rows
    # lora_a: [S, L, R, K]   stacked A weights, same dtype as x, R = max_lora_rank (zero padded)
    # out:    [S, T_max, R]  fp32, T_max >= T; rows of tokens with a slot are overwritten,
    #                        rows of slot -1 tokens are left untouched
    # meta:   prepared for these T tokens (meta.prepare(token_slots[:T])): its groups index x rows
    check(x.dim() == 2 and lora_a.dim() == 4 and out.dim() == 3,
          f"expected x [T, K], lora_a [S, L, R, K], out [S, T_max, R]; got {tuple(x.shape)}, "
          f"{tuple(lora_a.shape)}, {tuple(out.shape)}")
    T, K = x.shape
    S, L, R, Ka = lora_a.shape
    check(x.dtype in FLOAT_DTYPES and lora_a.dtype == x.dtype,
          f"x and lora_a must share a float dtype, got {x.dtype} and {lora_a.dtype}")
    check(out.dtype == torch.float32, f"out must be float32, got {out.dtype}")
    check(Ka == K, f"lora_a K={Ka} does not match x K={K}")
    check(1 <= S <= 3, f"1 to 3 slices supported, got {S}")
    check(out.shape[0] == S and out.shape[1] >= T and out.shape[2] == R,
          f"out must be [S={S}, >= {T}, R={R}], got {tuple(out.shape)}")
    check(x.stride(1) == 1 and lora_a.is_contiguous() and out.stride(2) == 1,
          "x rows, lora_a and out rows must be contiguous")
    check(T <= meta.max_tokens, f"{T} tokens exceed the metadata capacity {meta.max_tokens}")
    check(meta.active_slots.shape[0] == L + 1,
          f"meta was allocated for {meta.active_slots.shape[0] - 1} slots, lora_a has {L}")
    check(x.device == lora_a.device == out.device == meta.active_slots.device,
          "x, lora_a, out and meta must be on one device")
    if T == 0:
        return

    block_m, block_n, block_k, num_warps, num_stages = _config(T, R, K, x.element_size())
    grid = (triton.cdiv(T, block_m) * triton.cdiv(R, block_n), S, L + 1)
    _lora_shrink_kernel[grid](
        x, lora_a, out,
        meta.sorted_token_ids, meta.active_slots, meta.slot_token_count, meta.slot_token_start,
        K, R,
        x.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=(K % block_k == 0),
        num_warps=num_warps, num_stages=num_stages,
    )
