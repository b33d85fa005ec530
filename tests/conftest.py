import os

import pytest
import torch

# Without a GPU every Triton kernel runs under Triton's interpreter on CPU tensors. It reads
# TRITON_INTERPRET when triton is imported, so set it before any test module imports it (a
# subset such as `pytest tests/bench` then runs as the whole suite does).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the shared fixtures (tiny model dir, job factories), available in every folder
from tests.helpers.fixtures import char_model, job_factory, make_job, tiny_model  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    # Tests marked `gpu` need CUDA; on CPU machines they are skipped, not failed.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
