"""A projection's LoRA delta added to its output rows: h = rnd(x + delta), optionally with the
residual add after it (res = rnd(res + h)); the kernel the norms run before normalising
(kernels/fused_add_rms_norm.py), and on its own (`add_lora_delta`) for a projection whose next
op takes no delta: Qwen3's and Gemma 3's q/k norms between qkv_proj and the rotary.

x holds the columns of one slice of B (a fused projection's q, k or v): `slice_idx` picks the
slice's shrunk values, `col0` its first column in B's N. Tiles of 16-32 rows x CHUNK columns,
every program independent (B read once per tile and slot of its rows; see kernels/lora_delta.py
for the tile and gather forms). Static grid, no host syncs: CUDA-graph capturable.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_delta import (delta_args, gather_consts, lora_delta_rows,
                                         lora_delta_tile, row_block, tile_shrunk, tile_slots)
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.pdl import pdl_enter, pdl_kwargs
from batchrun.kernels.utils import check

DELTA_CHUNKS = 32  # column chunks per row (at least 128 columns each)


@triton.jit
def _add_lora_delta_kernel(
    x_ptr, res_ptr, h_ptr,   # h = rnd(x + delta) goes to h_ptr, or (FUSED_ADD) rnd(res + h) to res
    T, H,
    stride_x, stride_r, stride_h,
    s_ptr, stride_s, b_ptr, slot_ptr, LN, LS, LR,   # the LoRA delta of x
    slice_idx, col0,   # x's columns are slice `slice_idx` of B's N columns, from column col0
    FUSED_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr, GATHER: tl.constexpr, R_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    # Grid (row tiles, column chunks), every program independent: B is read once per tile and
    # slot of its rows' range, and the tile's delta is one tensor-core dot per slot.
    pdl_enter(PDL)
    tile = tl.program_id(0)
    c = tl.program_id(1)
    xdt = x_ptr.dtype.element_ty
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    col_mask = offs < H
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
    slot, lo, hi = tile_slots(slot_ptr, rows, row_mask)
    if GATHER:
        d, _ = lora_delta_rows(s_ptr, stride_s, b_ptr, rows, slot, slice_idx, slice_idx,
                               col0 + offs, col0 + offs, col_mask, LN, LS, LR, BLOCK_M, CHUNK,
                               BLOCK_R, R_CHUNK, PAIR=False)
    else:
        s = tile_shrunk(s_ptr, stride_s, rows, slot, slice_idx, LS, LR, BLOCK_R, DOT_IEEE)
        d, _ = lora_delta_tile(s, s, b_ptr, slot, lo, hi, col0 + offs, col0 + offs, col_mask, LN,
                               LR, BLOCK_M, CHUNK, BLOCK_R, DOT_IEEE, PAIR=False)
    h = (x.to(tl.float32) + d).to(xdt)                    # the x a separate expand would leave
    if FUSED_ADD:
        r_ptrs = res_ptr + rows64[:, None] * stride_r + offs[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        tl.store(r_ptrs, (r.to(tl.float32) + h.to(tl.float32)).to(xdt), mask=mask)
    else:
        tl.store(h_ptr + rows64[:, None] * stride_h + offs[None, :], h, mask=mask)


def launch_delta(x: Tensor, res: Tensor, h: Tensor, largs: tuple, consts: dict, *, fused_add: bool,
                 slice_idx: int = 0, col0: int = 0) -> None:
    """One launch over x [T, H] (see the kernel): largs, consts from delta_args."""
    T, H = x.shape
    bm = row_block(T)
    chunk = max(128, triton.next_power_of_2(triton.cdiv(H, DELTA_CHUNKS)))
    _add_lora_delta_kernel[(triton.cdiv(T, bm), triton.cdiv(H, chunk))](
        x, res, h, T, H, x.stride(0), res.stride(0), h.stride(0), *largs, slice_idx, col0,
        FUSED_ADD=fused_add, BLOCK_M=bm, CHUNK=chunk, **consts,
        **gather_consts(T, bm, chunk, consts["BLOCK_R"]), num_warps=4, num_stages=1,
        **pdl_kwargs(x))


def add_lora_delta(y: Tensor, lora: LoRADelta) -> Tensor:
    """y [T, N] (contiguous columns, rows may be strided) += its LoRA delta, in place, one
    launch per slice; returns y. The reference: LoRADelta.apply_reference."""
    check(y.dim() == 2 and y.stride(1) == 1, f"y must be [T, N] with contiguous rows, got "
                                             f"{tuple(y.shape)} strides {y.stride()}")
    T, N = y.shape
    largs, consts = delta_args(lora, T, N, lora.num_slices, y.device)
    if T == 0:
        return y
    offs = lora.slice_offsets
    for s in range(lora.num_slices):
        part = y[:, offs[s]:offs[s + 1]]
        launch_delta(part, part, part, largs, consts, fused_add=False, slice_idx=s, col0=offs[s])
    return y
