"""Small helpers shared by the kernel launchers."""
from __future__ import annotations

import torch
import triton

# Dtypes the kernels accept for activations / weights. fp32 works everywhere; bf16 is wrong
# under TRITON_INTERPRET on CPU (a Triton interpreter limitation), so CPU tests skip it.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dot_block(n: int, cap: int) -> int:
    # Tile width for a dot operand dimension: a power of two, >= 16 (tl.dot's minimum), <= cap.
    return max(16, min(cap, triton.next_power_of_2(n)))


def check(cond: bool, msg: str) -> None:
    # Launcher argument checks raise ValueError: callers pass shapes from config/user input.
    if not cond:
        raise ValueError(msg)
