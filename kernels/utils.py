"""Small helpers shared by the kernel launchers."""
from __future__ import annotations

import torch
import triton

# Dtypes the kernels accept for activations / weights. fp32 works everywhere; bf16 is wrong
# under TRITON_INTERPRET on CPU (a Triton interpreter limitation), so CPU tests skip it.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF_DTYPES = (torch.float16, torch.bfloat16)  # the GEMMs' (fp32 would need ieee dots)


def dot_block(n: int, cap: int) -> int:
    # Tile width for a dot operand dimension: a power of two, >= 16 (tl.dot's minimum), <= cap.
    return max(16, min(cap, triton.next_power_of_2(n)))


def check(cond: bool, msg: str) -> None:
    # Launcher argument checks raise ValueError: callers pass shapes from config/user input.
    if not cond:
        raise ValueError(msg)


def check_gemm_operands(x, w, what: str, max_rows: int | None = None) -> tuple[int, int, int]:
    """The checks batchrun's GEMM launchers share (x [M, K] @ w [N, K].T, fp16/bf16, rows
    contiguous, M <= max_rows when given); returns (M, N, K)."""
    check(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1],
          f"{what} needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if max_rows is not None:
        check(x.shape[0] <= max_rows, f"{what} takes M <= {max_rows} rows, got {x.shape[0]}")
    check(x.dtype in HALF_DTYPES and w.dtype == x.dtype,
          f"{what} needs fp16/bf16 x and w of one dtype, got {x.dtype} and {w.dtype}")
    check(x.stride(1) == 1 and w.stride(1) == 1, f"{what} needs x and w with contiguous rows")
    return x.shape[0], w.shape[0], x.shape[1]


def gemm_output(x, out, M: int, N: int):
    """`out` checked to be [M, N] in x's dtype with contiguous rows, or a new one."""
    if out is None:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    check(out.shape == (M, N) and out.dtype == x.dtype and out.stride(1) == 1,
          f"out must be [{M}, {N}] {x.dtype} with contiguous rows")
    return out


def check_attention_inputs(q, k_cache, v_cache, out, rows: str) -> tuple[int, int, int, int, int]:
    """The checks both paged attention launchers share; returns (rows, Hq, D, block_size, Hkv).
    ``rows``: what q's first dim is called in messages ("B" for decode, "T" for prefill)."""
    check(q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape,
          f"expected q [{rows}, Hq, D] and k/v caches [num_blocks, block_size, Hkv, D]; got "
          f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    n, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    check(Dk == D, f"head dim of q ({D}) and cache ({Dk}) differ")
    check(Hq % Hkv == 0, f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    check(q.dtype in FLOAT_DTYPES and out.dtype == q.dtype and k_cache.dtype == v_cache.dtype
          and k_cache.dtype in (q.dtype, torch.float8_e4m3fn),
          f"q and out must share a float dtype and the caches be of it or e4m3, got {q.dtype}, "
          f"{k_cache.dtype}, {v_cache.dtype}, {out.dtype}")
    check(out.shape == q.shape, f"out must be {tuple(q.shape)}, got {tuple(out.shape)}")
    return n, Hq, D, block_size, Hkv
