"""act(gate) * up (kernels/act_and_mul.py) for both activations against HF's ops
(ref_act_and_mul) and, for GELU-tanh, against an fp64 evaluation of its formula: fresh random
gates over the range where the activations bend and saturate, odd and model-sized widths,
strided rows."""
import math

import pytest
import torch

from batchrun.kernels.act_and_mul import ACTIVATIONS, act_and_mul
from batchrun.kernels.reference import ref_act_and_mul
from kernel_testutils import CPU_DTYPES, DEVICE, POISON, randn

EPS32 = torch.finfo(torch.float32).eps


def gelu_tanh_f64(g: torch.Tensor) -> torch.Tensor:
    # the tanh-approximated GELU 0.5 * g * (1 + tanh(y)), in fp64 as g * sigmoid(2y): the same
    # value, without 1 + tanh(y) cancelling to 0 in the left tail (even in fp64)
    g = g.double()
    return g * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))


def _gate_up(T, I, dtype, gen, row_pad=0):
    gate_up = randn(T, 2 * I + row_pad, dtype=dtype, gen=gen, scale=3.0)[:, :2 * I]
    # a few gates far out in both tails: saturation, exp overflow to inf, g^3 past fp16's range
    tails = torch.tensor([-40.0, -12.0, -5.0, 7.0, 30.0, 200.0], dtype=dtype)
    n = min(I, tails.numel())
    gate_up[0, :n] = tails[:n].to(DEVICE)
    return gate_up


def assert_close_to_hf(out, gate_up, activation, dtype):
    ref = ref_act_and_mul(gate_up, activation)
    gate, up = gate_up.float().chunk(2, dim=-1)
    # exp/div may differ by an fp32 ulp or two, which can flip the activation's rounding by one
    # ulp; the product rounds once more. torch's GELU-tanh goes through 1 + tanh, which near
    # tanh = -1 is off by about an fp32 ulp of 1, i.e. eps32 * |gate| after the 0.5 * gate.
    eps = torch.finfo(dtype).eps
    tol = (8 * eps if dtype == torch.float32 else 2 * eps) * ref.float().abs() + 1e-6
    if activation == "gelu_tanh":
        tol = tol + 2 * EPS32 * gate.abs() * up.abs()
    err = (out.float() - ref.float()).abs()
    assert not out.isnan().any()
    assert (err <= tol).all(), (err - tol).max().item()


def _check(T, I, dtype, seed, activation, row_pad=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = _gate_up(T, I, dtype, gen, row_pad)
    out = torch.full((T, I), POISON, dtype=dtype, device=DEVICE)
    assert act_and_mul(gate_up, activation, out=out) is out
    assert_close_to_hf(out, gate_up, activation, dtype)
    fresh = act_and_mul(gate_up, activation)
    assert fresh.shape == (T, I) and fresh.dtype == dtype and torch.equal(fresh, out)
    if activation == "gelu_tanh":
        # the kernel's activation against the exact formula, rounded to the dtype as HF's
        # act_fn output is. The kernel's fp32 value is off by a few fp32 ulps, and in the left
        # tail by |2 * inner| ulps more (exp(-2 * inner) carries inner's rounding); that may flip
        # the rounding to the dtype by one of its ulps. The product rounds once more; the
        # dtype's subnormal spacing bounds both roundings of tiny values. Where exp(-2 * inner)
        # overflows fp32 (past e^88) the kernel's activation is 0, the true one below 1e-37 |g|.
        gate, up = gate_up.double().chunk(2, dim=-1)
        act = gelu_tanh_f64(gate).to(dtype).double()
        truth = act * up
        fi = torch.finfo(dtype)
        tiny = fi.smallest_normal * fi.eps
        inner = 0.8 * gate.abs() + 0.036 * gate.abs() ** 3
        act_rel = (8 + 2 * inner) * EPS32 if dtype == torch.float32 else fi.eps
        tol = ((act_rel * act.abs() + tiny + 1e-37 * gate.abs()) * up.abs()
               + (8 * EPS32 if dtype == torch.float32 else fi.eps) * truth.abs() + tiny)
        assert ((out.double() - truth).abs() <= tol).all()


ACTS = pytest.mark.parametrize("activation", ACTIVATIONS)


@ACTS
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,I", [(1, 64), (5, 130), (3, 1000), (2, 1500), (4, 17), (2, 3840)])
def test_act_and_mul(T, I, dtype, activation):
    _check(T, I, dtype, seed=T * 7919 + I, activation=activation)


@ACTS
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_strided_rows(dtype, activation):
    _check(3, 96, dtype, seed=11, activation=activation, row_pad=10)


def test_silu_is_the_default():
    gate_up = randn(3, 2 * 40, dtype=torch.float16, gen=torch.Generator().manual_seed(2))
    assert torch.equal(act_and_mul(gate_up), act_and_mul(gate_up, "silu"))
    assert torch.equal(ref_act_and_mul(gate_up), ref_act_and_mul(gate_up, "silu"))
    assert not torch.equal(act_and_mul(gate_up), act_and_mul(gate_up, "gelu_tanh"))


def test_gelu_tanh_reference_is_hf_op():
    # ref_act_and_mul's GELU is torch's tanh approximation (HF's gelu_pytorch_tanh), in fp32
    gate_up = randn(4, 2 * 50, dtype=torch.float32, gen=torch.Generator().manual_seed(3), scale=3)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(ref_act_and_mul(gate_up, "gelu_tanh"),
                       torch.nn.functional.gelu(gate, approximate="tanh") * up)
    # torch's fp32 value is within about an fp32 ulp of |gate| of the exact one (the 1 + tanh
    # cancellation), which is the slack assert_close_to_hf gives the kernel
    assert ((ref_act_and_mul(gate_up, "gelu_tanh").double() - gelu_tanh_f64(gate) * up.double())
            .abs() <= 2 * EPS32 * (gate.abs() * up.abs()).double()).all()


def test_bad_args():
    with pytest.raises(ValueError):
        act_and_mul(torch.ones(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="activation"):
        act_and_mul(torch.ones(2, 8, device=DEVICE), "gelu")
    with pytest.raises(ValueError, match="activation"):
        ref_act_and_mul(torch.ones(2, 8), "relu")
    assert act_and_mul(torch.ones(0, 8, device=DEVICE)).shape == (0, 4)
    assert act_and_mul(torch.ones(0, 8, device=DEVICE), "gelu_tanh").shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@ACTS
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("I", [11008, 13824, 14336, 15360, 21504])
def test_bf16_gpu(T, I, activation):
    _check(T, I, torch.bfloat16, seed=T + I, activation=activation)
