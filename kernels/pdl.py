"""Programmatic dependent launch (PDL, sm_90+) for the kernels of a forward step.

Between two kernels of a stream the GPU idles about a microsecond (the second one launches only
once the first has drained). With PDL the second kernel may launch while the first still runs;
it then waits in `griddepcontrol.wait` until the first has finished and flushed its writes,
before it touches memory: inside a CUDA graph it saves part of every kernel boundary, more when
a W-streaming GEMM first asks L2 for the start of its weight rows (which no earlier kernel
writes), with outputs bit-equal to plain launches (docs/benchmarks.md's decision log).

Every kernel here that takes a `PDL` constexpr calls `pdl_enter(PDL)` before its first load or
store, and its launcher passes `**pdl_kwargs(t)`, which sets PDL and triton's `launch_pdl`
together (a kernel launched with launch_pdl but not waiting would race). A kernel launched
with PDL waits for the kernel before it; that one waited for its own predecessor before it
could finish, so every earlier write is visible too. Kernels without the hooks (cuBLAS, torch
ops) launch as before.

On unless BATCHRUN_PDL=0 (read once, when this module is imported; batchrun/engine/envs.py lists
the variables); off on CPU, on GPUs before sm_90, and under the Triton interpreter, where the
kernels are traced with PDL=False.
"""
from __future__ import annotations

import functools
import os
from typing import Final

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.errors import ConfigError

PREFETCH_COLS = tl.constexpr(256)  # W columns a skinny GEMM program asks L2 for before it waits (probe's best)


def flag_from_env(name: str, default: bool, environ=os.environ) -> bool:
    """A boolean BATCHRUN_* variable (1/0, true/false, yes/no, on/off; unset or empty: default)."""
    raw = environ.get(name, "")
    text = raw.strip().lower()
    if text == "":
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r}: expected one of 1/0, true/false, on/off")


ENABLED: Final = flag_from_env("BATCHRUN_PDL", True)


@functools.lru_cache(maxsize=None)
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_kwargs(t: Tensor) -> dict:
    """Launch keyword arguments of a kernel with a `PDL` constexpr, for a launch on t's device."""
    if ENABLED and t.is_cuda:
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if _sm90(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    # before a kernel's first load or store: wait for the kernel before it (and so for all
    # earlier ones), then let the next kernel launch (it waits likewise)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows_l2(w_ptr, rows, stride_w, N, K, COLS: tl.constexpr):
    # ask L2 for the first COLS of K elements (2-byte dtypes: one request a 128-byte line) of
    # W's rows `rows` (clamped to the N rows, the K columns): weights no kernel writes, so this
    # may run before pdl_enter
    lines = tl.minimum(tl.arange(0, COLS // 64) * 64, K - 1)
    ptrs = w_ptr + tl.minimum(rows, N - 1)[:, None].to(tl.int64) * stride_w + lines[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
