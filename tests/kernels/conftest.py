"""Kernel tests run the Triton kernels on CPU tensors under the Triton interpreter when no GPU
is present. TRITON_INTERPRET is read when triton is imported, so it must be set before any test
module (or batchrun.kernels) imports triton; conftest files are imported first.
(The root tests/conftest.py does the same for every test directory.)"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
