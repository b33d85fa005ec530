"""LoRA shrink (Punica SGMV), split over K: out[k, s, t, :] = x[t, chunk k] @ lora_a[s, slot[t], :, chunk k].T.

Decode has a handful of tokens, so without a split over K only ~S programs run, each streaming
all of K serially: latency-bound far above the launch floor. Each program here covers one K chunk
of one m-block of one slot's tokens (gathered through sorted_token_ids) and stores its fp32
partial product into its own split row of `out`; `lora_expand` sums the SPLIT partials when it
loads them. Every partial of every LoRA token is written (an empty tail chunk stores zeros), so
nothing needs pre-zeroing, there are no atomics and the sum order is fixed (deterministic); rows
of slot -1 tokens are never touched.

Grid = (splits x m-blocks x rank-blocks, slices, max_loras + 1): it depends only on static shapes,
so the launch can be captured in a CUDA graph and replayed after `LoRAKernelMeta.prepare`
rewrites the metadata. The split count comes from `shrink_num_splits(T, K, S)`, a pure function
of the same static shapes; callers size `out` with it (out.shape[0] is the split count).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.utils import FLOAT_DTYPES, check, dot_block

MAX_SPLITS = 32
_NUM_SMS = 132          # H100/H200; only steers the split heuristic
_MIN_SPLIT_K = 256      # K per program below which a split costs more than it saves


def _block_m(num_tokens: int) -> int:
    # Decode (small T) is short of programs: small m-blocks give more programs in flight.
    return 16 if num_tokens <= 128 else 32 if num_tokens <= 1024 else 64


def shrink_num_splits(num_tokens: int, K: int, num_slices: int) -> int:
    """Number of K splits (a power of two, 1..MAX_SPLITS) for `lora_shrink` on these shapes.

    Doubles the split while one adapter's programs (m-blocks x slices x splits) do not yet fill
    the GPU's SMs and each program keeps at least _MIN_SPLIT_K of K. Static shapes only, so a
    captured graph and its buffer views agree on it for every replay.
    """
    programs = triton.cdiv(max(num_tokens, 1), _block_m(num_tokens)) * num_slices
    splits = 1
    while (splits < MAX_SPLITS and programs * splits < _NUM_SMS
           and K // (2 * splits) >= _MIN_SPLIT_K):
        splits *= 2
    return splits


@triton.jit
def _lora_shrink_kernel(
    # pointers
    x_ptr,            # [T, K]
    a_ptr,            # [S, L, R, K]
    out_ptr,          # [SPLIT, S, T_max, R] fp32
    sorted_ids_ptr,   # int32 [max_tokens]
    active_ptr,       # int32 [L + 1]
    count_ptr,        # int32 [L + 1]
    start_ptr,        # int32 [L + 1]
    # sizes
    K, R, CHUNK_K,    # CHUNK_K: K per split, a multiple of BLOCK_K
    # strides (last dims are contiguous)
    stride_xt,
    stride_as, stride_al, stride_ar,
    stride_ok, stride_os, stride_ot,
    # constexprs
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,   # K % BLOCK_K == 0: no tile needs a K mask
):
    pid = tl.program_id(0)
    s = tl.program_id(1)
    entry = tl.program_id(2)
    num_n = tl.cdiv(R, BLOCK_N)
    pid_k = pid % SPLIT
    pid_mn = pid // SPLIT
    pid_m = pid_mn // num_n
    pid_n = pid_mn % num_n

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
    k0 = tl.multiple_of(pid_k * CHUNK_K, BLOCK_K)  # tiles stay aligned: vector loads
    offs_k = tl.arange(0, BLOCK_K)
    # K left in this chunk (0 for empty tail chunks: the loop is skipped and zeros are stored).
    k_len = tl.maximum(tl.minimum(CHUNK_K, K - k0), 0)

    x_ptrs = x_ptr + tok[:, None] * stride_xt + (k0 + offs_k)[None, :]                 # [BM, BK]
    a_base = a_ptr + s.to(tl.int64) * stride_as + slot.to(tl.int64) * stride_al
    a_ptrs = a_base + offs_n[None, :] * stride_ar + (k0 + offs_k)[:, None]             # [BK, BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            at = tl.load(a_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < k_len - k * BLOCK_K
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        # "ieee": exact fp32 products for fp32 inputs (no tf32); no effect for 16-bit inputs.
        acc = tl.dot(xt, at, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K

    out_ptrs = (out_ptr + pid_k.to(tl.int64) * stride_ok + s.to(tl.int64) * stride_os
                + tok[:, None] * stride_ot + offs_n[None, :])
    tl.store(out_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


def _config(T: int, R: int, K: int, splits: int, elem_bytes: int) -> tuple[int, ...]:
    block_m = _block_m(T)
    block_n = dot_block(R, 64)
    # Rows of 512 B (decode) / 256 B per K-tile, no wider than one split's share of K: with
    # splits, a decode program does one or two tiles, all of whose loads are issued at once.
    block_k = (512 if block_m == 16 else 256) // elem_bytes
    block_k = min(block_k, dot_block(triton.cdiv(K, splits), 256))
    chunk_k = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    # Stages as deep as ~160 KB of shared memory allows (H100/H200 have 227 KB per SM), and no
    # deeper than the loop: short loops keep shared memory small so several programs share an SM.
    stage_bytes = (block_m + block_n) * block_k * elem_bytes
    iters = chunk_k // block_k
    num_stages = max(2, min(4, iters + 1, (160 * 1024) // stage_bytes))
    return block_m, block_n, block_k, chunk_k, 4, num_stages


def lora_shrink(x: Tensor, lora_a: Tensor, out: Tensor, meta: LoRAKernelMeta) -> None:
    # x:      [T, K]                fp16/bf16/fp32, contiguous rows
    # lora_a: [S, L, R, K]          stacked A weights, same dtype as x, R = max_lora_rank (zero padded);
    #                               any strides over S, L, R (rows of K contiguous)
    # out:    [SPLIT, S, T_max, R]  fp32, T_max >= T, SPLIT = number of K splits (any >= 1; use
    #                               shrink_num_splits(T, K, S)); for tokens with a slot every
    #                               split's partial is overwritten (their sum is x @ A.T); rows of
    #                               slot -1 tokens are left untouched
    # meta:   prepared for these T tokens (meta.prepare(token_slots[:T])): its groups index x rows
    check(x.dim() == 2 and lora_a.dim() == 4 and out.dim() == 4,
          f"expected x [T, K], lora_a [S, L, R, K], out [SPLIT, S, T_max, R]; got "
          f"{tuple(x.shape)}, {tuple(lora_a.shape)}, {tuple(out.shape)}")
    T, K = x.shape
    S, L, R, Ka = lora_a.shape
    splits = out.shape[0]
    check(x.dtype in FLOAT_DTYPES and lora_a.dtype == x.dtype,
          f"x and lora_a must share a float dtype, got {x.dtype} and {lora_a.dtype}")
    check(out.dtype == torch.float32, f"out must be float32, got {out.dtype}")
    check(Ka == K, f"lora_a K={Ka} does not match x K={K}")
    check(1 <= S <= 3, f"1 to 3 slices supported, got {S}")
    check(1 <= splits <= MAX_SPLITS, f"out must have 1 to {MAX_SPLITS} splits, got {splits}")
    check(out.shape[1] == S and out.shape[2] >= T and out.shape[3] == R,
          f"out must be [SPLIT, S={S}, >= {T}, R={R}], got {tuple(out.shape)}")
    # lora_a may be strided over S and L (the engine's slot-major storage is a transposed view)
    check(x.stride(1) == 1 and lora_a.stride(3) == 1 and out.stride(3) == 1,
          "x rows, lora_a rows and out rows must be contiguous")
    check(T <= meta.max_tokens, f"{T} tokens exceed the metadata capacity {meta.max_tokens}")
    check(meta.active_slots.shape[0] == L + 1,
          f"meta was allocated for {meta.active_slots.shape[0] - 1} slots, lora_a has {L}")
    check(x.device == lora_a.device == out.device == meta.active_slots.device,
          "x, lora_a, out and meta must be on one device")
    if T == 0:
        return

    block_m, block_n, block_k, chunk_k, num_warps, num_stages = _config(
        T, R, K, splits, x.element_size())
    grid = (splits * triton.cdiv(T, block_m) * triton.cdiv(R, block_n), S, L + 1)
    _lora_shrink_kernel[grid](
        x, lora_a, out,
        meta.sorted_token_ids, meta.active_slots, meta.slot_token_count, meta.slot_token_start,
        K, R, chunk_k,
        x.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        SPLIT=splits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=(K % block_k == 0),
        num_warps=num_warps, num_stages=num_stages,
    )
