"""add_lora_delta: a fused projection's LoRA delta added to its output in place, one launch per
slice (q, k, v of different widths), against LoRADelta.apply_reference (ref_lora_delta), over
slot patterns, slot bounds below the slot count, both delta forms (gather and tiles)."""
import pytest
import torch

import batchrun.kernels.lora_delta as lora_delta
from batchrun.kernels.add_lora_delta import add_lora_delta
from kernel_testutils import CPU_DTYPES
from test_lora_fused_consumers import _fused_output, _tol


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,sizes,L,R,k", [(1, [64, 32, 32], 2, 16, None), (5, [128, 64, 64], 3, 8, 2),
                                           (8, [96, 48, 48], 4, 4, None), (33, [256, 130, 130], 2, 16, 1),
                                           (16, [40, 40], 3, 7, None)])
@pytest.mark.parametrize("pattern", ["mixed", "sorted", "gaps", "none"])
def test_matches_the_reference(T, sizes, L, R, k, pattern, dtype):
    y, delta, slots = _fused_output(T, sizes, L, R, dtype, seed=T + 7 * L + R, pattern=pattern, k=k)
    want = delta.apply_reference(y.clone())
    before = y.clone()
    got = add_lora_delta(y, delta)
    assert got.data_ptr() == y.data_ptr()  # in place, into the fused GEMM's output view
    scale = want.float().abs().mean(-1, keepdim=True)
    assert (got.float() - want.float()).abs().le(_tol(want, dtype, scale)).all()
    none = slots < 0
    assert torch.equal(got[none], before[none])  # rows without an adapter are untouched


@pytest.mark.parametrize("gather_max_rows", [0, 64])  # the tile form, the gather form
def test_both_delta_forms(gather_max_rows, monkeypatch):
    monkeypatch.setattr(lora_delta, "GATHER_MAX_ROWS", gather_max_rows)
    y, delta, _ = _fused_output(12, [64, 32, 32], 3, 8, torch.float32, seed=3)
    want = delta.apply_reference(y.clone())
    torch.testing.assert_close(add_lora_delta(y, delta), want, rtol=1e-5, atol=1e-5)


def test_refuses_a_delta_of_another_width():
    y, delta, _ = _fused_output(4, [64, 32, 32], 2, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="does not fit"):
        add_lora_delta(y[:, :96], delta)
