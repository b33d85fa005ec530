"""y = x @ W.T for a throughput decode step (up to 256 rows) with all rows in one M tile, so
each weight tile is read from HBM once. A candidate for #12's offline workload, not yet timed
on a GPU (its bf16 test passed on an H100, 2026-12-06): the engine takes it only with `engine.triton_full_rows_gemm: true` (off by default;
layers/gemm.py), benchmarks/gemm_m256.py prices it against cuBLAS.

Why: at M = 256 a Llama-2-7b decode step's GEMMs are 3.4 TFLOP over 13.2 GB of weights, close
to the ridge point of an H100 (memory-bound) or an H200 (compute-bound). cuBLAS takes 6.3 ms a
step on the H100 against a 3.9 ms floor (benchmarks/offline_step_profile.py, 2026-12-06),
the largest gap left in that step. This kernel gives each program BLOCK_N output columns of
every row (BLOCK_M >= M) and walks its share of K: one [BLOCK_M, BLOCK_K] tile of x (a few
hundred KB in all, from L2) and one [BLOCK_K, BLOCK_N] tile of W per step, a tensor-core dot
into an fp32 accumulator. Narrow weights (o, down: N = 4096 gives 32 column tiles of 128 for
132 SMs) split K over SPLIT_K programs, which write fp32 partials that a second kernel sums in
a fixed order (deterministic) and rounds once. Grid from static shapes: graph capturable.

Bigger M runs several M tiles; they are the fastest grid axis, so the tiles of one column block
run together and share its W tile through L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.utils import check, check_gemm_operands, gemm_output, nearest_shape

# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_stages, num_warps); untuned until the GPU sweep
CONFIG = (256, 128, 64, 1, 3, 8)
# Per weight shape (N, K) -> config, from benchmarks/gemm_m256.py's sweep (`set_tuned` replaces
# it for a benchmark). A weight of another N takes the entry of its K with the nearest N (a
# LoRA step's stacked [W; A] is W's N plus a few dozen rows); no entry of its K: CONFIG.
TUNED: dict[tuple[int, int], tuple[int, int, int, int, int, int]] = {}


def config_for(N: int, K: int) -> tuple[int, int, int, int, int, int]:
    """The tile config full_rows_gemm takes for a [N, K] weight when the caller gives none."""
    return nearest_shape(TUNED, N, K) or CONFIG


def set_tuned(configs: dict[tuple[int, int], tuple[int, int, int, int, int, int]]) -> None:
    """Replace TUNED (benchmarks: the best configs of a sweep run in the same process)."""
    for key, cfg in configs.items():
        check(len(key) == 2 and len(cfg) == 6, f"bad tuned entry {key}: {cfg}")
    TUNED.clear()
    TUNED.update({tuple(k): tuple(v) for k, v in configs.items()})


@triton.jit
def _full_rows_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, M, N, K, K_SPLIT,
                           stride_xm, stride_wn, stride_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k)[:, None]
    row_mask = (rows < M)[:, None]
    col_mask = (cols < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # every split holds whole K tiles
            x = tl.load(x_ptrs, mask=row_mask, other=0.0)
            w = tl.load(w_ptrs, mask=col_mask, other=0.0)
        else:
            k_in = k0 + offs_k < k_hi
            x = tl.load(x_ptrs, mask=row_mask & k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_mask & k_in[:, None], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = row_mask & col_mask
    if SPLIT_K == 1:
        if HAS_BIAS:  # in fp32, rounded once with the sum
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = ws_ptr + (pid_k * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(p_ptrs, acc, mask=mask)


@triton.jit
def _split_k_sum_kernel(ws_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    # y[r, c] = rnd(sum over s in order of ws[s, r, c] (+ bias[c]))
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    r = offs // N
    c = offs % N
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * stride_ym + c, acc.to(y_ptr.dtype.element_ty), mask=mask)


def full_rows_gemm(x: Tensor, w: Tensor, bias: Tensor | None = None, out: Tensor | None = None,
                   config: tuple[int, int, int, int, int, int] | None = None) -> Tensor:
    # x: [M, K] (rows may be strided), w: [N, K] contiguous rows, fp16/bf16 -> y [M, N];
    # bias [N] (x's dtype) added in fp32 before the one rounding.
    # config: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_stages, num_warps); BLOCK_M shrinks to
    # the next power of two >= M (at least 16), SPLIT_K to what K's tiles allow.
    M, N, K = check_gemm_operands(x, w, "full_rows_gemm")
    check(x.device == w.device, "x and w must be on one device")
    if bias is not None:
        check(bias.shape == (N,) and bias.dtype == x.dtype and bias.is_contiguous()
              and bias.device == x.device, f"bias must be a contiguous [{N}] {x.dtype} tensor")
    out = gemm_output(x, out, M, N)
    if M == 0 or N == 0:
        return out
    bm, bn, bk, split_k, stages, warps = config or config_for(N, K)
    bm = min(bm, max(16, triton.next_power_of_2(M)))
    k_split = triton.cdiv(triton.cdiv(K, split_k), bk) * bk  # whole K tiles per split
    splits = triton.cdiv(K, k_split)
    ws = (torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1
          else out)
    b = bias if bias is not None else out  # unused without HAS_BIAS
    _full_rows_gemm_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), splits)](
        x, w, b, out, ws, M, N, K, k_split, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=splits, EVEN_K=K % bk == 0,
        HAS_BIAS=bias is not None, num_stages=stages, num_warps=warps)
    if splits > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(M * N, block),)](
            ws, b, out, M, N, out.stride(0), SPLIT_K=splits, HAS_BIAS=bias is not None,
            BLOCK=block, num_warps=4)
    return out
