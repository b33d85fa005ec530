"""The step plan's GEMM choice (engine/step_plan.py), a pure function of the step's rows, the
model's dtype and weight shapes and the device; and a Linear runs what the plan names."""
import pytest
import torch

import batchrun.engine.step_plan as step_plan
from batchrun.engine.layers.linear import Linear
from batchrun.engine.layers.step import GEMM_KINDS, GemmPlan, Step

SHAPES = {"qkv_proj": (12288, 4096), "o_proj": (4096, 4096), "gate_up_proj": (22016, 4096),
          "down_proj": (4096, 11008), "lm_head": (32000, 4096)}  # Llama-2-7b


def test_few_rows_of_16_bit_weights_on_triton_stream_the_wide_weights(monkeypatch):
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    half = torch.empty(0, dtype=torch.bfloat16)
    plan = step_plan.plan_gemms(True, 8, half, SHAPES)
    assert plan == GemmPlan(qkv_proj="skinny", o_proj=None, gate_up_proj="skinny",
                            down_proj=None, lm_head="skinny")
    assert plan.gate_up_silu
    assert step_plan.plan_gemms(True, 16, half, SHAPES) == plan  # the largest skinny step
    # cuBLAS everywhere: more rows, the switch off, fp32, or no Triton
    cublas = GemmPlan()
    assert step_plan.plan_gemms(True, 17, half, SHAPES) == cublas
    assert step_plan.plan_gemms(False, 8, half, SHAPES) == cublas
    assert step_plan.plan_gemms(True, 8, torch.empty(0), SHAPES) == cublas
    monkeypatch.delenv("BATCHRUN_FORCE_TRITON")
    assert step_plan.plan_gemms(True, 8, half, SHAPES) == cublas
    assert not cublas.gate_up_silu


def test_a_linear_runs_the_kernel_its_step_plan_names(monkeypatch):
    import batchrun.engine.layers.gemm as gemm
    seen = []
    monkeypatch.setattr(gemm.F, "linear", lambda x, w, b: seen.append("cublas") or x @ w.T)
    lin = Linear(8, [4], name="o_proj")
    lin.weight.data.normal_()
    x = torch.randn(2, 8)
    lin(x, Step(None))
    assert seen == ["cublas"]
    with pytest.raises(ValueError, match="unknown GEMM kernel"):
        lin(x, Step(None, gemm=GemmPlan(o_proj="bogus")))
    with pytest.raises(ValueError, match="step plan's projection kinds"):
        Linear(8, [4], name="q_proj")
    assert set(GEMM_KINDS) == set(SHAPES)
