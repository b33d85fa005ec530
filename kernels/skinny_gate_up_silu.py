"""act(x @ W_gate.T) * (x @ W_up.T) for decode's few rows: the gate_up GEMM with the act-and-mul
in its epilogue, one launch instead of two. The activation is a constexpr, "silu" or "gelu_tanh"
(kernels/act_and_mul.py's ACTIVATIONS); the file and function names, which the step plan uses,
say silu for either.

w is the fused gate_up weight [2*I, K] (gate rows first, as Linear stores it). Each program
streams BLOCK_N rows of W_gate and the same BLOCK_N rows of W_up (the K loop of
kernels/skinny_gemm.py, twice), rounds each accumulator to the output dtype (the gate_up tensor
the unfused path would have written) and applies kernels/act_and_mul.py's `_act_mul` to them:
so the result is bit-for-bit skinny_gemm (with the same BLOCK_K) followed by act_and_mul,
without writing or reading the [M, 2*I] intermediate or paying the second launch.

With `lora` (a LoRADelta of the gate and up slices) the epilogue adds each row's delta to the
rounded gate and up before the activation, as act_and_mul's LoRA kernel does after a GEMM over
[W; A]: so the result is bit-for-bit skinny_gemm + act_and_mul(lora=) given the same shrunk
values. The shrink x . A comes from the norm before gate_up (kernels/rms_norm_shrink.py), so a
LoRA decode step streams only W here. Rows with slot -1 get exactly the no-LoRA kernel's values.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.lora_delta import (_slot_dot, delta_args, gather_consts, lora_delta_rows,
                                        lora_delta_tile, tile_shrunk, tile_slots)
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.act_and_mul import ACTIVATIONS, _act_mul
from batchrun.kernels.skinny_gemm import MAX_ROWS, _stream_dot
from batchrun.kernels.pdl import PREFETCH_COLS, pdl_enter, pdl_kwargs, prefetch_rows_l2
from batchrun.kernels.utils import check, check_gemm_operands, gemm_output

# (BLOCK_N, BLOCK_K, num_stages, num_warps): BLOCK_N columns of gate and of up per program; the
# fastest of the configurations `benchmarks/kernels.py gemm --sweep` times
CONFIG = (32, 256, 3, 4)


@triton.jit
def _skinny_gate_up_silu_kernel(x_ptr, w_ptr, y_ptr, M, I, K, stride_xm, stride_wn, stride_ym,
                                s_ptr, stride_s, b_ptr, slot_ptr, LN, LS, LR,   # HAS_LORA only
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                EVEN_K: tl.constexpr, HAS_LORA: tl.constexpr,
                                BLOCK_R: tl.constexpr, DOT_IEEE: tl.constexpr,
                                GATHER: tl.constexpr, R_CHUNK: tl.constexpr,
                                ONE_SLOT: tl.constexpr, ACTIVATION: tl.constexpr,
                                PDL: tl.constexpr):
    rows = tl.arange(0, 16)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    if PDL:  # W's gate and up rows stream while the kernel before still runs (kernels/pdl.py)
        prefetch_rows_l2(w_ptr, cols, stride_wn, I, K, PREFETCH_COLS)
        prefetch_rows_l2(w_ptr + I * stride_wn, cols, stride_wn, I, K, PREFETCH_COLS)
    pdl_enter(PDL)
    if HAS_LORA and ONE_SLOT:
        # slot bound 1: every LoRA row is in slot 0, so the tile's LoRA operands are one [16, R]
        # shrunk tile and one [R, BLOCK_N] B tile per slice. Loaded before the K loop and used
        # after it, their latency hides behind the weight stream instead of following it.
        slot, lo, hi = tile_slots(slot_ptr, rows, rows < M)
        sg = tile_shrunk(s_ptr, stride_s, rows, slot, 0, LS, LR, BLOCK_R, DOT_IEEE)
        su = tile_shrunk(s_ptr, stride_s, rows, slot, 1, LS, LR, BLOCK_R, DOT_IEEE)
        offs_r = tl.arange(0, BLOCK_R)
        b_mask = (offs_r < LR)[:, None] & col_mask[None, :]
        b_at = b_ptr + cols.to(tl.int64)[None, :] * LR + offs_r[:, None]
        bg = tl.load(b_at, mask=b_mask, other=0.0)
        bu = tl.load(b_at + I * LR, mask=b_mask, other=0.0)
    g = _stream_dot(tl.zeros((16, BLOCK_N), dtype=tl.float32), x_ptr, w_ptr, rows, cols, M, I, K,
                    stride_xm, stride_wn, BLOCK_K, EVEN_K)
    u = _stream_dot(tl.zeros((16, BLOCK_N), dtype=tl.float32), x_ptr, w_ptr + I * stride_wn,
                    rows, cols, M, I, K, stride_xm, stride_wn, BLOCK_K, EVEN_K)
    dt = y_ptr.dtype.element_ty
    g = g.to(dt)
    u = u.to(dt)
    if HAS_LORA:  # act_and_mul's LoRA kernel's epilogue: gate and up + their delta, rounded
        if ONE_SLOT:  # lora_delta_tile's one iteration, slot 0, on the prefetched operands
            zero = tl.zeros((16, BLOCK_N), dtype=tl.float32)
            dg = _slot_dot(zero, sg, slot == 0, bg, DOT_IEEE)
            du = _slot_dot(zero, su, slot == 0, bu, DOT_IEEE)
        else:
            slot, lo, hi = tile_slots(slot_ptr, rows, rows < M)
            if GATHER:
                dg, du = lora_delta_rows(s_ptr, stride_s, b_ptr, rows, slot, 0, 1, cols,
                                         cols + I, col_mask, LN, LS, LR, 16, BLOCK_N, BLOCK_R,
                                         R_CHUNK, PAIR=True)
            else:
                sg = tile_shrunk(s_ptr, stride_s, rows, slot, 0, LS, LR, BLOCK_R, DOT_IEEE)
                su = tile_shrunk(s_ptr, stride_s, rows, slot, 1, LS, LR, BLOCK_R, DOT_IEEE)
                dg, du = lora_delta_tile(sg, su, b_ptr, slot, lo, hi, cols, cols + I, col_mask,
                                         LN, LR, 16, BLOCK_N, BLOCK_R, DOT_IEEE, PAIR=True)
        g = (g.to(tl.float32) + dg).to(dt)
        u = (u.to(tl.float32) + du).to(dt)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], _act_mul(g, u, dt, ACTIVATION),
             mask=(rows < M)[:, None] & col_mask[None, :])


def skinny_gate_up_silu(x: Tensor, w: Tensor, out: Tensor | None = None,
                        config: tuple[int, int, int, int] = CONFIG,
                        lora: LoRADelta | None = None, activation: str = "silu") -> Tensor:
    # x [M <= 16, K], w [2*I, K] (gate; up) -> act(x @ w[:I].T) * (x @ w[I:].T), [M, I];
    # lora: the delta of gate_up's two slices, added to gate and up before the activation;
    # activation: one of ACTIVATIONS
    check(activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    M, N, K = check_gemm_operands(x, w, "skinny_gate_up_silu", MAX_ROWS)
    check(N % 2 == 0, f"the gate_up weight must have 2*I rows, got {N}")
    I = N // 2
    out = gemm_output(x, out, M, I)
    if lora is not None:
        largs, consts = delta_args(lora, M, N, 2, x.device)
        consts.update(gather_consts(M, 16, config[0], consts["BLOCK_R"], pairs=2),
                      # slot bound 1 (one adapter in use): the LoRA operands are loaded
                      # before the K loop (see the kernel)
                      ONE_SLOT=lora.num_slots == 1)
    else:
        largs = (x, 0, x, x, 0, 0, 0)
        consts = dict(BLOCK_R=16, DOT_IEEE=False, GATHER=False, R_CHUNK=1, ONE_SLOT=False)
    if M == 0 or I == 0:
        return out
    bn, bk, stages, warps = config
    _skinny_gate_up_silu_kernel[(triton.cdiv(I, bn),)](
        x, w, out, M, I, K, x.stride(0), w.stride(0), out.stride(0), *largs,
        BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % bk == 0, HAS_LORA=lora is not None, **consts,
        ACTIVATION=activation, num_stages=stages, num_warps=warps, **pdl_kwargs(x))
    return out
