"""kernels/pdl.py: when the Triton kernels take programmatic dependent launch. The kernels' own
hooks (pdl_enter, the L2 prefetch) only compile for sm_90+ GPUs: tests/gpu/test_engine_gpu.py
checks on a GPU that an engine's tokens and logits are bit-equal with it on and off."""
import pytest
import torch

import batchrun.kernels.pdl as pdl


@pytest.fixture
def restore_pdl():
    before = pdl.ENABLED
    yield
    pdl.set_pdl(before)


@pytest.fixture
def enabled(restore_pdl):
    pdl.set_pdl(True)


def test_off_on_cpu_even_when_enabled(enabled):
    # PDL and launch_pdl always come together, and never for a CPU (interpreter) launch
    assert pdl.pdl_kwargs(torch.empty(2)) == {"PDL": False}


def test_off_when_disabled(restore_pdl):
    pdl.set_pdl(False)
    assert pdl.pdl_kwargs(torch.empty(2)) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_for_sm90(enabled):
    t = torch.empty(2, device="cuda")
    want = {"PDL": True, "launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 \
        else {"PDL": False}
    assert pdl.pdl_kwargs(t) == want
