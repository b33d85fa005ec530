"""kernels/pdl.py: when the Triton kernels take programmatic dependent launch. The kernels' own
hooks (pdl_enter, the L2 prefetch) only compile for sm_90+ GPUs: tests/gpu/test_engine_gpu.py
checks on a GPU that an engine's tokens and logits are bit-equal with it on and off.

PDL is on unless BATCHRUN_PDL=0, read once when the module is imported (no setter); the tests
below that need it on or off patch the module constant."""
import os
import subprocess
import sys

import pytest
import torch

import batchrun.kernels.pdl as pdl
from batchrun.errors import ConfigError


def test_off_on_cpu_even_when_enabled(monkeypatch):
    # PDL and launch_pdl always come together, and never for a CPU (interpreter) launch
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.pdl_kwargs(torch.empty(2)) == {"PDL": False}


def test_off_when_disabled(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_kwargs(torch.empty(2)) == {"PDL": False}


@pytest.mark.parametrize("value, enabled", [(None, True), ("", True), ("0", False),
                                            ("off", False), ("1", True), ("TRUE", True)])
def test_read_once_from_the_environment_at_import(value, enabled):
    env = {k: v for k, v in os.environ.items() if k != "BATCHRUN_PDL"}
    if value is not None:
        env["BATCHRUN_PDL"] = value
    out = subprocess.run([sys.executable, "-c", "import batchrun.kernels.pdl as p; print(p.ENABLED)"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == str(enabled)
    assert not hasattr(pdl, "set_pdl")


def test_a_bad_value_names_the_variable():
    with pytest.raises(ConfigError, match=r"BATCHRUN_PDL='maybe': expected one of 1/0"):
        pdl.flag_from_env("BATCHRUN_PDL", True, {"BATCHRUN_PDL": "maybe"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_for_sm90(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    t = torch.empty(2, device="cuda")
    want = {"PDL": True, "launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9 \
        else {"PDL": False}
    assert pdl.pdl_kwargs(t) == want
