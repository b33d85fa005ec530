"""SiLU(x @ W_gate.T) * (x @ W_up.T) for decode's few rows: the gate_up GEMM with the SiLU-and-mul
in its epilogue, one launch instead of two.

w is the fused gate_up weight [2*I, K] (gate rows first, as Linear stores it). Each program
streams BLOCK_N rows of W_gate and the same BLOCK_N rows of W_up (the K loop of
kernels/skinny_gemm.py, twice), rounds each accumulator to the output dtype (the gate_up tensor
the unfused path would have written) and applies kernels/silu_and_mul.py's `_silu_mul` to them:
so the result is bit-for-bit skinny_gemm (with the same BLOCK_K) followed by silu_and_mul,
without writing or reading the [M, 2*I] intermediate or paying the second launch. LoRA steps do
not come here: their delta must reach gate and up before the SiLU (silu_and_mul's LoRA kernel
does that).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.silu_and_mul import _silu_mul
from batchrun.kernels.skinny_gemm import _stream_dot, check_operands, output
from batchrun.kernels.utils import check

# (BLOCK_N, BLOCK_K, num_stages, num_warps): BLOCK_N columns of gate and of up per program; the
# best of those timed on the H100 (benchmarks/skinny_gemm.py; (16, 256, 4, 4) was 28 % slower)
CONFIG = (32, 256, 3, 4)


@triton.jit
def _skinny_gate_up_silu_kernel(x_ptr, w_ptr, y_ptr, M, I, K, stride_xm, stride_wn, stride_ym,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                EVEN_K: tl.constexpr):
    rows = tl.arange(0, 16)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = _stream_dot(tl.zeros((16, BLOCK_N), dtype=tl.float32), x_ptr, w_ptr, rows, cols, M, I, K,
                    stride_xm, stride_wn, BLOCK_K, EVEN_K)
    u = _stream_dot(tl.zeros((16, BLOCK_N), dtype=tl.float32), x_ptr, w_ptr + I * stride_wn,
                    rows, cols, M, I, K, stride_xm, stride_wn, BLOCK_K, EVEN_K)
    dt = y_ptr.dtype.element_ty
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], _silu_mul(g.to(dt), u.to(dt), dt),
             mask=(rows < M)[:, None] & (cols < I)[None, :])


def skinny_gate_up_silu(x: Tensor, w: Tensor, out: Tensor | None = None,
                        config: tuple[int, int, int, int] = CONFIG) -> Tensor:
    # x [M <= 16, K], w [2*I, K] (gate; up) -> silu(x @ w[:I].T) * (x @ w[I:].T), [M, I]
    M, N, K = check_operands(x, w, "skinny_gate_up_silu")
    check(N % 2 == 0, f"the gate_up weight must have 2*I rows, got {N}")
    I = N // 2
    out = output(x, out, M, I)
    if M == 0 or I == 0:
        return out
    bn, bk, stages, warps = config
    _skinny_gate_up_silu_kernel[(triton.cdiv(I, bn),)](
        x, w, out, M, I, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, num_stages=stages, num_warps=warps)
    return out
