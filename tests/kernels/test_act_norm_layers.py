"""The engine layers (engine/layers/norm.py RMSNorm, activation.py act_and_mul, gemm.py
gate_up_silu) with Gemma's options: the CPU path against HF's modules (Gemma3RMSNorm,
LlamaRMSNorm, GELUTanh, SiLU) bit for bit and against the formulas written out in fp32, and the
Triton path (BATCHRUN_FORCE_TRITON=1, interpreted) against the CPU path; the per-head norm on a
strided head view of a fused qkv output."""
import math

import pytest
import torch
import torch.nn.functional as F

from batchrun.engine.layers.activation import act_and_mul
from batchrun.engine.layers.gemm import gate_up_silu
from batchrun.engine.layers.norm import RMSNorm
from batchrun.kernels.reference import ref_gate_up_silu
from kernel_testutils import CPU_DTYPES, randn

EPS = 1e-6
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]   # the CPU path runs torch: bf16 too


def _norm(H, offset, dtype, gen):
    # stored weights as checkpoints hold them: near 1 (Llama), near 0 (Gemma: scale 1 + w)
    norm = RMSNorm(H, EPS, offset=offset)
    norm.weight.data = (torch.randn(H, generator=gen) * 0.5 + (1 - offset)).to(dtype)
    return norm


def _gemma_formula(x, w):
    # Gemma3RMSNorm.forward written out: fp32 normalise, * (1 + w) in fp32, cast to x's dtype
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (out * (1.0 + w.float())).to(x.dtype)


def _llama_formula(x, w):
    # LlamaRMSNorm.forward written out: fp32 normalise, cast to x's dtype, then * w
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _qkv_heads(T, H, D, dtype, gen):
    # the fused qkv output [T, 3*H*D + pad] and its q and k head views [T, H, D] (strided)
    qkv = randn(T, 3 * H * D + 3, dtype=dtype, gen=gen, device="cpu")
    return qkv, qkv[:, :H * D].view(T, H, D), qkv[:, H * D:2 * H * D].view(T, H, D)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("H", [3584, 3840, 5120, 1001])
def test_cpu_norm_is_hf_formula(H, dtype):
    gen = torch.Generator().manual_seed(H)
    x = randn(4, H, dtype=dtype, gen=gen, scale=3.0, device="cpu")
    res = randn(4, H, dtype=dtype, gen=gen, device="cpu")
    gemma, llama = _norm(H, 1.0, dtype, gen), _norm(H, 0.0, dtype, gen)
    assert torch.equal(gemma(x), _gemma_formula(x, gemma.weight))
    assert torch.equal(llama(x), _llama_formula(x, llama.weight))
    # with the residual add before it (in the model dtype)
    normed, new_res = gemma(x, res)
    assert torch.equal(new_res, res + x) and torch.equal(normed, _gemma_formula(res + x, gemma.weight))
    # Gemma's rounding differs from the Llama formula on 1 + w
    shifted = _llama_formula(x, (1 + gemma.weight.float()).to(dtype))
    assert dtype == torch.float32 or not torch.equal(gemma(x), shifted)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_cpu_norm_is_hf_module(dtype):
    hf = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")
    llama_hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    gen = torch.Generator().manual_seed(1)
    H, D = 3840, 256
    x = randn(5, H, dtype=dtype, gen=gen, scale=2.0, device="cpu")
    for offset, module in ((1.0, hf.Gemma3RMSNorm(H, eps=EPS)),
                           (0.0, llama_hf.LlamaRMSNorm(H, eps=EPS))):
        ours = _norm(H, offset, dtype, gen)
        module.weight.data = ours.weight.data.clone()
        assert torch.equal(ours(x), module(x)), offset
    # per-head q norm (Gemma3Attention's q_norm over head_dim) on the q view of a qkv output
    _, q, _ = _qkv_heads(3, 16, D, dtype, gen)
    ours, module = _norm(D, 1.0, dtype, gen), hf.Gemma3RMSNorm(D, eps=EPS)
    module.weight.data = ours.weight.data.clone()
    assert torch.equal(ours(q), module(q))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_cpu_per_head_norm(dtype, offset):
    gen = torch.Generator().manual_seed(2)
    T, H, D = 5, 4, 256
    qkv, q, k = _qkv_heads(T, H, D, dtype, gen)
    before = qkv.clone()
    norm = _norm(D, offset, dtype, gen)
    got = norm(k)
    assert torch.equal(qkv, before) and got.shape == (T, H, D)
    formula = _gemma_formula if offset else _llama_formula
    for t in range(T):
        for h in range(H):
            assert torch.equal(got[t, h], formula(k[t, h][None], norm.weight)[0])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_triton_norm_matches_cpu(dtype, offset, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    T, H = 3, 3584
    x = randn(T, H + 4, dtype=dtype, gen=gen, device="cpu")[:, :H]
    res = randn(T, H, dtype=dtype, gen=gen, device="cpu")
    norm = _norm(H, offset, dtype, gen)
    _, q, k = _qkv_heads(T, 8, 256, dtype, gen)
    head_norm = _norm(256, offset, dtype, gen)
    cpu = norm(x), norm(x, res.clone()), head_norm(q), head_norm(k)
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    res_t = res.clone()
    tri = norm(x), norm(x, res_t), head_norm(q), head_norm(k)
    assert torch.equal(res_t, cpu[1][1])                 # the residual, updated in place
    eps = 16 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for got, want in ((tri[0], cpu[0]), (tri[1][0], cpu[1][0]), (tri[2], cpu[2]), (tri[3], cpu[3])):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert ((got.float() - want.float()).abs() <= eps * want.float().abs() + 1e-6).all()


def test_per_head_norm_refuses_residual_and_lora(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    _, q, _ = _qkv_heads(2, 2, 64, torch.float32, gen)
    norm = _norm(64, 1.0, torch.float32, gen)
    for force in ("0", "1"):
        monkeypatch.setenv("BATCHRUN_FORCE_TRITON", force)
        with pytest.raises(ValueError, match="per-head"):
            norm(q, q.clone())


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("I", [14336, 15360, 1001])
def test_cpu_act_and_mul_is_hf(I, dtype):
    gen = torch.Generator().manual_seed(I)
    gate_up = randn(3, 2 * I, dtype=dtype, gen=gen, scale=3.0, device="cpu")
    gate, up = gate_up.chunk(2, dim=-1)
    # HF's gated MLP: act_fn(gate) * up in the model dtype, act_fn computed in fp32 and rounded
    gelu = (0.5 * gate.float() * (1 + torch.tanh(math.sqrt(2 / math.pi)
                                                 * (gate.float() + 0.044715 * gate.float() ** 3))))
    got = act_and_mul(gate_up, "gelu_tanh")
    assert torch.equal(got, F.gelu(gate, approximate="tanh") * up)
    # the formula in fp32 (its own tanh) is within an fp32 ulp of |gate| of torch's before the
    # rounding to the dtype, which may then differ by one of its ulps; the product rounds once
    # more (to a subnormal, for tiny values)
    fi = torch.finfo(dtype)
    tiny = fi.smallest_normal * fi.eps
    tol = ((fi.eps * gelu.abs() + 2 * torch.finfo(torch.float32).eps * gate.float().abs() + tiny)
           * up.float().abs() + fi.eps * got.float().abs() + tiny)
    assert ((got.float() - gelu.to(dtype).float() * up.float()).abs() <= tol).all()
    assert torch.equal(act_and_mul(gate_up), F.silu(gate) * up)
    assert torch.equal(act_and_mul(gate_up, "silu"), act_and_mul(gate_up))
    acts = pytest.importorskip("transformers.activations")
    assert torch.equal(got, acts.ACT2FN["gelu_pytorch_tanh"](gate) * up)
    assert torch.equal(act_and_mul(gate_up), acts.ACT2FN["silu"](gate) * up)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_triton_act_and_mul_matches_cpu(dtype, activation, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    gate_up = randn(4, 2 * 3840, dtype=dtype, gen=gen, scale=3.0, device="cpu")
    cpu = act_and_mul(gate_up, activation)
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    tri = act_and_mul(gate_up, activation)
    gate, up = gate_up.float().chunk(2, dim=-1)
    eps = torch.finfo(dtype).eps
    tol = ((8 * eps if dtype == torch.float32 else 2 * eps) * cpu.float().abs()
           + 2 * torch.finfo(torch.float32).eps * gate.abs() * up.abs() + 1e-6)
    assert ((tri.float() - cpu.float()).abs() <= tol).all()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gate_up_silu_layer_passes_the_activation(activation):
    gen = torch.Generator().manual_seed(6)
    x = randn(3, 256, dtype=torch.float16, gen=gen, device="cpu")
    w = randn(2 * 96, 256, dtype=torch.float16, gen=gen, scale=256 ** -0.5, device="cpu")
    got = gate_up_silu(x, w, activation=activation)
    ref = ref_gate_up_silu(x, w, activation)
    tol = 4 * torch.finfo(torch.float16).eps * ref.float().abs() + 1e-3
    assert ((got.float() - ref.float()).abs() <= tol).all()
    other = "gelu_tanh" if activation == "silu" else "silu"
    assert not torch.equal(got, gate_up_silu(x, w, activation=other))
