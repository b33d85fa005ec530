import pytest
import torch

from batchrun.kernels.reference import ref_silu_and_mul
from batchrun.kernels.silu_and_mul import silu_and_mul
from kernel_testutils import CPU_DTYPES, DEVICE, POISON, randn


def _check(T, I, dtype, seed, row_pad=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = randn(T, 2 * I + row_pad, dtype=dtype, gen=gen, scale=3.0)[:, :2 * I]
    out = torch.full((T, I), POISON, dtype=dtype, device=DEVICE)
    assert silu_and_mul(gate_up, out=out) is out
    ref = ref_silu_and_mul(gate_up)
    # exp/div may differ by an fp32 ulp or two, which can flip silu's rounding by one ulp;
    # the product rounds once more.
    eps = torch.finfo(dtype).eps
    tol = (8 * eps if dtype == torch.float32 else 2 * eps) * ref.float().abs() + 1e-6
    err = (out.float() - ref.float()).abs()
    assert (err <= tol).all(), err.max().item()
    fresh = silu_and_mul(gate_up)
    assert fresh.shape == (T, I) and fresh.dtype == dtype and torch.equal(fresh, out)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,I", [(1, 64), (5, 130), (3, 1000), (2, 1500), (4, 17)])
def test_silu_and_mul(T, I, dtype):
    _check(T, I, dtype, seed=T * 7919 + I)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_strided_rows(dtype):
    _check(3, 96, dtype, seed=11, row_pad=10)


def test_bad_args():
    with pytest.raises(ValueError):
        silu_and_mul(torch.ones(2, 7, device=DEVICE))
    assert silu_and_mul(torch.ones(0, 8, device=DEVICE)).shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("I", [11008, 13824, 14336])
def test_bf16_gpu(T, I):
    _check(T, I, torch.bfloat16, seed=T + I)
