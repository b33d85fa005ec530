"""LoRA delta of one token over a tile of output columns: a device function that the
elementwise kernels after each projection (rotary, RMSNorm, SiLU-and-mul) call when they run a
LoRA decode step, so the delta costs no launch of its own.

Where the inputs come from (batchrun/engine/lora/layer.py): a LoRA-able Linear keeps its weight and
the A matrices of every slot in one tensor [N + S*L*R, K], so on a LoRA step one base GEMM also
computes the shrink: columns N.. of its output hold `shrunk[t, (s*L + l)*R + r] = x[t] .
A[s, l, r]` for every slice s, slot l and rank r. The consumer then adds, for token t with slot
l = slot[t] >= 0 and output column n of slice s,

    delta[t, n] = sum_r shrunk[t, (s*L + l)*R + r] * B[l, n, r]        (fp32 accumulation)

with B stored [L, N, R] (fused output layout, scaling folded in). Tokens with slot -1 (no LoRA,
padding) get 0. The caller rounds `y + delta` once to the model dtype, which is what a separate
expand kernel writing y would have produced.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.utils import FLOAT_DTYPES, check


@triton.jit
def lora_delta(
    s_ptr,        # shrunk [T, S*L*R] (row stride stride_s, last dim contiguous), any float dtype
    stride_s,
    b_ptr,        # lora_b [L, N, R] contiguous
    slot_ptr,     # int32 [>= T]: slot per token, -1 = none
    t,            # token (row) index, int64 scalar
    slice_idx,    # slice of the fused output these columns belong to (scalar)
    cols,         # int [M, C]: output columns (indices into N), any 2-D tile
    mask,         # bool [M, C]
    N, L, R,
    BLOCK_R: tl.constexpr,   # >= R, a power of two
    R_CHUNK: tl.constexpr,   # ranks loaded per step (bounds registers: M*C*R_CHUNK values)
):
    slot = tl.load(slot_ptr + t)
    r_used = tl.where(slot >= 0, R, 0)  # slot -1: every load masked off, delta 0
    slot64 = tl.maximum(slot, 0).to(tl.int64)
    s_row = s_ptr + t * stride_s + (slice_idx * L + slot64) * R
    b_slot = b_ptr + slot64 * N * R
    cols3 = cols.to(tl.int64)[:, :, None] * R
    mask3 = mask[:, :, None]
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    # Unrolled: all chunks' loads are independent, so they are in flight together.
    for r0 in tl.static_range(0, BLOCK_R, R_CHUNK):
        offs_r = r0 + tl.arange(0, R_CHUNK)
        r_mask = offs_r < r_used
        s = tl.load(s_row + offs_r, mask=r_mask, other=0.0).to(tl.float32)         # [RC]
        b = tl.load(b_slot + cols3 + offs_r[None, None, :],
                    mask=mask3 & r_mask[None, None, :], other=0.0)                # [M, C, RC]
        acc += tl.sum(b.to(tl.float32) * s[None, None, :], axis=2)
    return acc


def r_chunk(block_r: int, tile: int, budget: int = 4096) -> int:
    # Ranks per step so that a [tile, R_CHUNK] load stays within `budget` values per program
    # (a power of two: block_r and budget are).
    return max(1, min(block_r, budget // triton.next_power_of_2(max(1, tile))))


def delta_args(lora: LoRADelta | None, like: Tensor, T: int, N: int, num_slices: int):
    """(kernel args, BLOCK_R) for the lora_delta parameters of a consumer kernel.

    args = (s_ptr, stride_s, b_ptr, slot_ptr, N, L, R). Without a delta the kernel is compiled
    with HAS_LORA=False and never reads them: fixed placeholders, so the no-LoRA launch is the
    same specialisation whether or not the engine has LoRA enabled.
    """
    if lora is None:
        return (like, 0, like, like, 0, 0, 0), 1
    lora.validate(T, N, num_slices, like.device)
    L, _, R = lora.lora_b.shape
    check(lora.shrunk.dtype in FLOAT_DTYPES and lora.lora_b.dtype in FLOAT_DTYPES,
          "LoRA shrunk values and lora_b must be float tensors")
    args = (lora.shrunk, lora.shrunk.stride(0), lora.lora_b, lora.token_slots, N, L, R)
    return args, triton.next_power_of_2(R)
