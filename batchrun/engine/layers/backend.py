"""Which implementation a layer runs: the Triton kernels on CUDA, the torch references on CPU.

BATCHRUN_FORCE_TRITON=1 (with TRITON_INTERPRET=1) makes CPU tensors take the Triton path too, so
CPU tests can run the GPU code path, kernels included, under the interpreter. Read per call
(cheap) so tests can flip it.
"""
from __future__ import annotations

import os

from torch import Tensor


def use_triton(t: Tensor) -> bool:
    return t.is_cuda or os.environ.get("BATCHRUN_FORCE_TRITON") == "1"
