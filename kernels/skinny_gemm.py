"""y = x @ W.T (+ bias) for decode's few rows: a GEMM that does nothing but stream W.

At M <= 16 rows a decode GEMM is bound by reading the weight once from HBM. cuBLAS reaches
75-88 % of the copy rate there and splits K over programs for the narrower weights, which costs
a second (reduce) launch per GEMM. This kernel gives each program BLOCK_N output columns and
walks all of K: one [16, BLOCK_K] tile of x (rows past M masked; x is a few KB and stays in L2)
and one [BLOCK_N, BLOCK_K] tile of W per step, a tensor-core dot into an fp32 [16, BLOCK_N]
accumulator, bias added in fp32, rounded once to the output dtype (what cuBLAS without split-K
computes). One launch, no workspace; grid from static shapes, so CUDA-graph capturable.

Narrow weights (N = 4096: 128 column tiles for 132 SMs) may split K (`split_k`), still in one
launch: each program writes its fp32 partial to a workspace and takes a ticket for its column
tile, and the tile's last program sums the partials in split order (deterministic), rounds once
and resets the ticket (a per-device int32 buffer, zero between launches).

`skinny_gemm_lora` is a fused LoRA step's one-slice projection (o_proj, down_proj) over
[W; A]: the A rows' column tiles come first in the grid, write the shrink and count themselves
done; each W tile's last program waits for that count and adds its rows' delta before
rounding, so no delta kernel runs after it.

Each output column is the same sum whatever N is (given the same K split), so the columns W
shares with a longer stacked weight (LoRA's [W; A] rows) come out bit-identical in both GEMMs.

`_stream_dot` is the K loop, shared with kernels/skinny_gate_up_silu.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.pdl import PREFETCH_COLS, pdl_enter, pdl_kwargs, prefetch_rows_l2
from batchrun.kernels.lora_delta import (gather_consts, lora_delta_rows, lora_delta_tile, tile_shrunk,
                                        tile_slots)
from batchrun.kernels.utils import (check, check_gemm_operands, dot_block, gemm_output,
                                   nearest_shape)

MAX_ROWS = 16  # x's rows: one tl.dot tile (its minimum M)
# (BLOCK_N, BLOCK_K, num_stages, num_warps): the best of the configurations timed on the H100
# for the Llama-2-7b / 3-8b decode shapes at M = 1, 8, 16 (benchmarks/skinny_gemm.py)
CONFIG = (32, 128, 6, 4)
# Narrow weights (o_proj, down_proj: N = 4096 gives 128 programs of 32 columns for 132 SMs)
# split K over programs: (N, K) -> (config, split_k), from benchmarks/narrow_gemm.py (weights
# cold in L2); the nearest N of the same K applies (kernels/utils.nearest_shape). Empty: those
# weights stay on cuBLAS (layers/gemm.py). `set_split_tuned` replaces it for a benchmark.
# The H100 sweep of 2026-12-06 (docs/benchmarks.md, session 16) chose {(4096, 4096):
# ((32, 256, 4, 4), 1), (4096, 11008): ((64, 128, 5, 4), 2)}: a base b8 graph step 1.0 %
# faster. With the chunked residual norm-shrink (session 17, H100, its own sweep's entries)
# the b8 graph step was 1.003 x cuBLAS's LoRA-disabled, 1 active 1.011 x, 8 active 0.970 x:
# no gain for base rows on a second machine, so it stays empty until an H200 run shows one.
SPLIT_TUNED: dict[tuple[int, int], tuple[tuple[int, int, int, int], int]] = {}


def split_config_for(N: int, K: int) -> tuple[tuple[int, int, int, int], int] | None:
    """(config, split_k) for a narrow [N, K] weight, or None: not tuned, cuBLAS keeps it."""
    return nearest_shape(SPLIT_TUNED, N, K)


def set_split_tuned(table: dict) -> None:
    """Replace SPLIT_TUNED: (N, K) -> (config of 4, split_k >= 1)."""
    for key, (cfg, split) in table.items():
        check(len(key) == 2 and len(cfg) == 4 and split >= 1, f"bad split entry {key}: {cfg}, {split}")
    SPLIT_TUNED.clear()
    SPLIT_TUNED.update({tuple(k): (tuple(c), int(s)) for k, (c, s) in table.items()})


@triton.jit
def _stream_dot(acc, x_ptr, w_ptr, rows, cols, M, N, K, stride_xm, stride_wn,
                BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # acc [16, BLOCK_N] fp32 += x[rows, :K] @ w[cols, :K].T
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    row_mask, col_mask = (rows < M)[:, None], (cols < N)[:, None]
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_mask, other=0.0)
            w = tl.load(w_ptrs, mask=col_mask, other=0.0)
        else:
            k_mask = (k0 + offs_k < K)[None, :]
            x = tl.load(x_ptrs, mask=row_mask & k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=col_mask & k_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, K_SPLIT,
                        stride_xm, stride_wn, stride_ym,
                        NW, A_TILES, lb_ptr, slot_ptr, LR,   # HAS_LORA only (see skinny_gemm_lora)
                        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_LORA: tl.constexpr,
                        BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr, GATHER: tl.constexpr,
                        R_CHUNK: tl.constexpr, PDL: tl.constexpr):
    rows = tl.arange(0, 16)
    pid_n = tl.program_id(0)
    n_tiles = tl.num_programs(0)
    if HAS_LORA:
        # column tiles 0..A_TILES-1 are the A rows' (columns NW..N: the shrink), dispatched
        # first; the rest are W's (columns 0..NW), whose epilogue adds the delta
        is_a = pid_n < A_TILES
        col0 = tl.where(is_a, NW + pid_n * BLOCK_N, (pid_n - A_TILES) * BLOCK_N)
        n_lim = tl.where(is_a, N, NW)
    else:
        col0 = pid_n * BLOCK_N
        n_lim = N
    cols = col0 + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(1) * K_SPLIT  # this program's share of K: [k_lo, k_lo + K_SPLIT)
    if PDL:  # W streams while the kernel before still runs (kernels/pdl.py)
        prefetch_rows_l2(w_ptr + k_lo, cols, stride_wn, n_lim, K - k_lo, PREFETCH_COLS)
    pdl_enter(PDL)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc = _stream_dot(acc, x_ptr + k_lo, w_ptr + k_lo, rows, cols, M, n_lim,
                      tl.minimum(K_SPLIT, K - k_lo), stride_xm, stride_wn, BLOCK_K, EVEN_K)
    col_mask = cols < n_lim
    mask = (rows < M)[:, None] & col_mask[None, :]
    last = True
    if SPLIT_K > 1:
        # Split-K in one launch: each program leaves its fp32 partial in the workspace
        # [SPLIT_K, 16, N] and takes a ticket for its column tile; the tile's last program
        # sums the SPLIT_K partials in split order (the same sum whoever comes last:
        # deterministic), rounds once and resets the ticket for the next launch.
        tl.store(ws_ptr + (tl.program_id(1) * 16 + rows[:, None]) * N + cols[None, :], acc,
                 mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases it
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        last = ticket == SPLIT_K - 1
        if last:
            acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # from L2 (.cg): other SMs wrote them
                acc += tl.load(ws_ptr + (s * 16 + rows[:, None]) * N + cols[None, :], mask=mask,
                               other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    if last:
        dt = y_ptr.dtype.element_ty
        if HAS_BIAS:  # in fp32, rounded once with the sum
            acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dt)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        if HAS_LORA:
            if is_a:  # the shrink of this tile's slots' ranks: publish it to the W tiles
                tl.store(y_ptrs, y, mask=mask)
                tl.debug_barrier()
                tl.atomic_add(cnt_ptr + n_tiles, 1, sem="release", scope="gpu")
            else:
                y = (y.to(tl.float32) + _shrunk_delta(
                    y_ptr, stride_ym, cnt_ptr + n_tiles, A_TILES, n_tiles - A_TILES, rows, M,
                    cols, col_mask, NW, lb_ptr, slot_ptr, LR, BLOCK_N, BLOCK_R, DOT_IEEE,
                    GATHER, R_CHUNK)).to(dt)
                tl.store(y_ptrs, y, mask=mask)
        else:
            tl.store(y_ptrs, y, mask=mask)


@triton.jit
def _shrunk_delta(y_ptr, stride_ym, flag_ptr, A_TILES, W_TILES, rows, M, cols, col_mask, NW,
                  lb_ptr, slot_ptr, LR, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                  DOT_IEEE: tl.constexpr, GATHER: tl.constexpr, R_CHUNK: tl.constexpr):
    # fp32 [16, BLOCK_N] LoRA delta of a W tile, once the A tiles have written the shrink into
    # the output's columns NW.. (flag_ptr[0] counts them; flag_ptr[1] counts the W tiles that
    # have read it, and the last one resets both for the next launch). The A tiles have the
    # lowest program ids, so they are dispatched before any W tile whose last split waits here.
    done = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while done < A_TILES:
        done = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    slot, lo, hi = tile_slots(slot_ptr, rows, rows < M)
    s_ptr = y_ptr + NW  # the shrink: one slice (S = 1), slot-major columns l * R + r
    if GATHER:
        d, _ = lora_delta_rows(s_ptr, stride_ym, lb_ptr, rows, slot, 0, 0, cols, cols, col_mask,
                               NW, 1, LR, 16, BLOCK_N, BLOCK_R, R_CHUNK, PAIR=False)
    else:
        s = tile_shrunk(s_ptr, stride_ym, rows, slot, 0, 1, LR, BLOCK_R, DOT_IEEE)
        d, _ = lora_delta_tile(s, s, lb_ptr, slot, lo, hi, cols, cols, col_mask, NW, LR, 16,
                               BLOCK_N, BLOCK_R, DOT_IEEE, PAIR=False)
    tl.debug_barrier()  # the whole tile has read the shrink before its reader count goes up
    if tl.atomic_add(flag_ptr + 1, 1, sem="acq_rel", scope="gpu") == W_TILES - 1:
        tl.atomic_xchg(flag_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(flag_ptr + 1, 0, sem="relaxed", scope="gpu")
    return d


_TICKETS: dict[torch.device, Tensor] = {}


def _tickets(device: torch.device, n: int) -> Tensor:
    # The counters of `device`: int32 zeros, shared by every split or LoRA launch on it: a
    # ticket per column tile, then (skinny_gemm_lora) the shrink's done and read counts. Each
    # launch's programs reset theirs to 0; kernels of one stream run in order, so launches
    # never share them at once. Allocated outside graph capture, at the
    # eager warm-up every captured shape gets first (model_runner / graphs.py).
    t = _TICKETS.get(device)
    if t is None or t.numel() < n:
        check(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
              "skinny_gemm split-K: run the shape once eagerly before capturing a CUDA graph "
              "(its ticket buffer is allocated outside the graph)")
        t = _TICKETS[device] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return t


def skinny_gemm(x: Tensor, w: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
                config: tuple[int, int, int, int] = CONFIG, split_k: int = 1) -> Tensor:
    # x [M <= 16, K] @ w [N, K].T (+ bias [N]) -> [M, N] in x's dtype; split_k > 1 splits K
    # over that many programs per column tile (narrow weights: more programs than SMs)
    M, N, K = check_gemm_operands(x, w, "skinny_gemm", MAX_ROWS)
    out = gemm_output(x, out, M, N)
    _launch(x, w, bias, out, config, split_k, None)
    return out


def skinny_gemm_lora(x: Tensor, w_full: Tensor, n_out: int, lora_b: Tensor, token_slots: Tensor,
                     bias: Tensor | None = None, config: tuple[int, int, int, int] = CONFIG,
                     split_k: int = 1) -> Tensor:
    """A fused LoRA step's projection of one slice (o_proj, down_proj) in one launch:
    w_full = [W; A] (W's n_out rows, then the A rows of slots 0..k-1, k*R of them, slot-major,
    as a LoRALinear stacks them). The A rows' column tiles compute each row's shrink x . A
    (rounded to x's dtype, as the stacked GEMM's extra columns) and run first; each W tile's
    epilogue then adds its rows' delta shrunk . B[slot] (lora_b [L, n_out, R], token_slots
    int32 [>= M], -1 = none) to the rounded y: [M, n_out] = rnd(rnd(x W.T + bias) + delta),
    what the GEMM over [W; A] followed by the norm's delta kernel leaves, without that launch.
    Rows of slot -1 get exactly skinny_gemm's values (same config and split)."""
    M, N, K = check_gemm_operands(x, w_full, "skinny_gemm_lora", MAX_ROWS)
    check(lora_b.dim() == 3 and lora_b.is_contiguous() and lora_b.device == x.device,
          f"lora_b must be a contiguous [L, {n_out}, R] tensor on {x.device}")
    L, nb, R = lora_b.shape
    k = (N - n_out) // R if R else 0
    check(nb == n_out and 0 < n_out < N and (N - n_out) == k * R and 1 <= k <= L,
          f"skinny_gemm_lora: w_full [{N}, {K}] must be W [{n_out}, K] over the A rows of "
          f"1..{L} slots of rank {R} (lora_b {tuple(lora_b.shape)})")
    check(token_slots.dtype == torch.int32 and token_slots.numel() >= M
          and token_slots.device == x.device, f"token_slots must be int32 [>= {M}] on {x.device}")
    full = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _launch(x, w_full, bias, full, config, split_k, (n_out, lora_b, token_slots))
    return full[:, :n_out]


def _launch(x, w, bias, out, config, split_k: int, lora) -> None:
    M, K = x.shape
    N = w.shape[0]
    check(bias is None or (bias.shape == (N,) and bias.stride(0) == 1),
          f"bias must be a contiguous [{N}], got {None if bias is None else tuple(bias.shape)}")
    check(split_k >= 1, f"split_k must be >= 1, got {split_k}")
    if M == 0 or N == 0:
        return
    bn, bk, stages, warps = config
    k_split = triton.cdiv(triton.cdiv(K, split_k), bk) * bk  # whole K tiles per split
    splits = triton.cdiv(K, k_split)
    if lora is None:
        n_w, a_tiles, lora_args = N, 0, (x, x, 1)
        consts = dict(BLOCK_R=16, DOT_IEEE=False, GATHER=False, R_CHUNK=1)
    else:
        n_w, lora_b, token_slots = lora
        a_tiles = triton.cdiv(N - n_w, bn)
        R = lora_b.shape[2]
        lora_args = (lora_b, token_slots, R)
        block_r = dot_block(R, triton.next_power_of_2(R))
        consts = dict(BLOCK_R=block_r, DOT_IEEE=lora_b.dtype != x.dtype,
                      **gather_consts(M, 16, bn, block_r))
    tiles = a_tiles + triton.cdiv(n_w, bn)
    if splits > 1 or lora is not None:  # tickets per tile, then the shrink's two counters
        tickets = _tickets(x.device, tiles + 2)
    else:
        tickets = out  # unused
    ws = (torch.empty(splits * 16 * N, dtype=torch.float32, device=x.device) if splits > 1
          else out)
    _skinny_gemm_kernel[(tiles, splits)](
        x, w, x if bias is None else bias, out, ws, tickets, M, N, K, k_split,
        x.stride(0), w.stride(0), out.stride(0), n_w, a_tiles, *lora_args,
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, SPLIT_K=splits,
        HAS_LORA=lora is not None, **consts, num_stages=stages, num_warps=warps,
        **pdl_kwargs(x))
