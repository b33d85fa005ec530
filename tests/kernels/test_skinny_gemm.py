"""The decode GEMMs of few rows (kernels/skinny_gemm.py, kernels/skinny_gate_up_silu.py with either
activation) against their torch references, over odd shapes (M below 16, N and K off the tiles,
strided rows, bias) with fresh random inputs: under the Triton interpreter on CPU (fp16) and in
bf16 on a GPU at the Llama 7B/8B and Gemma 2/3 decode shapes."""
import pytest
import torch

from batchrun.kernels.act_and_mul import ACTIVATIONS, act_and_mul
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.reference import ref_act_and_mul, ref_gate_up_silu, ref_linear
from batchrun.kernels.skinny_gate_up_silu import CONFIG as FUSED_CONFIG, skinny_gate_up_silu
from batchrun.kernels.skinny_gemm import skinny_gemm
from kernel_testutils import DEVICE, POISON, assert_gemm_close, mixed_slots, randn

SAME_K_STEPS = (32, FUSED_CONFIG[1], 3, 4)  # skinny_gemm's K loop with the fused kernel's BLOCK_K
SHAPES = [(1, 16, 32), (5, 50, 70), (8, 96, 512), (13, 33, 300), (16, 64, 256)]


def _operands(M, N, K, dtype, seed, pad=0):
    g = torch.Generator().manual_seed(seed)
    x = randn(M, K + pad, dtype=dtype, gen=g)[:, :K]           # pad > 0: strided rows
    w = randn(N, K + pad, dtype=dtype, gen=g, scale=K ** -0.5)[:, :K]
    return x, w, g


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm(M, N, K, bias):
    x, w, g = _operands(M, N, K, torch.float16, seed=M * 1000 + N + K)
    b = randn(N, dtype=torch.float16, gen=g) if bias else None
    out = torch.full((M, N), POISON, dtype=torch.float16, device=DEVICE)
    assert skinny_gemm(x, w, b, out=out) is out
    assert_gemm_close(out, x, w, b)


def test_skinny_gemm_strided_rows_and_out():
    x, w, g = _operands(6, 40, 130, torch.float16, seed=3, pad=9)
    big = torch.full((6, 50), POISON, dtype=torch.float16, device=DEVICE)
    skinny_gemm(x, w, out=big[:, 5:45])
    assert_gemm_close(big[:, 5:45], x, w)
    assert (big[:, :5] == POISON).all() and (big[:, 45:] == POISON).all()


def test_columns_do_not_depend_on_the_rest_of_the_weight():
    # LoRA's fused step runs the GEMM on [W; A]: its first N columns must equal the plain GEMM's
    x, w, g = _operands(7, 48, 200, torch.float16, seed=5)
    stacked = torch.cat([w, randn(40, 200, dtype=torch.float16, gen=g)])
    assert torch.equal(skinny_gemm(x, stacked)[:, :48], skinny_gemm(x, w))


ACTS = pytest.mark.parametrize("activation", ACTIVATIONS)


@ACTS
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_skinny_gate_up_silu(M, N, K, activation):
    x, w, _ = _operands(M, 2 * N, K, torch.float16, seed=M + N * 7 + K)
    out = torch.full((M, N), POISON, dtype=torch.float16, device=DEVICE)
    assert skinny_gate_up_silu(x, w, out=out, activation=activation) is out
    # bit for bit the unfused pair it replaces, given the same K steps (same rounding points).
    # gate and up come from one GEMM each, so every column sits where the fused kernel has it
    # in its tile: the interpreter's dot (numpy) may sum a column in another order at another
    # position, and an fp32 ulp there can flip a near-tie rounding to fp16.
    gate_up = torch.cat([skinny_gemm(x, w[:N], config=SAME_K_STEPS),
                         skinny_gemm(x, w[N:], config=SAME_K_STEPS)], dim=-1)
    assert torch.equal(out, act_and_mul(gate_up, activation))
    ref = ref_gate_up_silu(x, w, activation)
    # gate/up may round one ulp apart from the reference's, which the activation and the
    # product carry
    tol = 4 * torch.finfo(torch.float16).eps * ref.float().abs() + 1e-3
    assert ((out.float() - ref.float()).abs() <= tol).all()


def test_skinny_gate_up_silu_default_is_silu():
    x, w, _ = _operands(3, 2 * 40, 64, torch.float16, seed=4)
    assert torch.equal(skinny_gate_up_silu(x, w), skinny_gate_up_silu(x, w, activation="silu"))
    assert not torch.equal(skinny_gate_up_silu(x, w),
                           skinny_gate_up_silu(x, w, activation="gelu_tanh"))


def _gate_up_lora(M, I, K, L, R, k, dtype, seed, pattern):
    # x, w [2I, K], and a LoRADelta of gate_up's two slices as the norm kernel leaves it
    # (shrunk [M, k*2*R], strided rows), slots < k: "mixed" (-1 and every slot), "one", "none"
    x, w, g = _operands(M, 2 * I, K, dtype, seed=seed)
    shrunk = randn(M, k * 2 * R + 3, dtype=dtype, gen=g)[:, :k * 2 * R]
    lora_b = randn(L, 2 * I, R, dtype=dtype, gen=g, scale=R ** -0.5)
    if pattern == "mixed":
        slots = mixed_slots(M, k, g)
    else:
        slots = torch.full((M,), k - 1 if pattern == "one" else -1, dtype=torch.int32)
    slots = torch.cat([slots, torch.zeros(4, dtype=torch.int32)]).to(DEVICE)  # a buffer >= M
    return x, w, LoRADelta(shrunk, lora_b, slots, (0, I, 2 * I)), slots[:M]


def _act_mul_tol(gate_up, base, out_dtype, activation="silu"):
    # bound on |act(g) * u - ref| where the kernel's g and u (rounded values) may each differ
    # from the reference's: base = x . W (before the delta) rounds apart by an ulp of |base|
    # (GEMM sum order), and g = rnd(base + delta) by an ulp of |g| again. Where the delta
    # cancels base, |g| is small but its error is an ulp of |base|: the bound is in |base|.
    g, u = gate_up.float().chunk(2, dim=-1)
    bg, bu = base.float().abs().chunk(2, dim=-1)
    eps = torch.finfo(out_dtype).eps
    dg, du = 2 * eps * (bg + g.abs()), 2 * eps * (bu + u.abs())
    gr = g.clone().requires_grad_()
    act = ref_act_and_mul(torch.cat([gr, torch.ones_like(gr)], dim=-1), activation)
    (slope,) = torch.autograd.grad(act.sum(), gr)
    act = act.detach()
    # |act'| <= 1.13 for both; slack for g moving (|act''| <= 0.8)
    dact = slope.abs() + dg
    return dact * dg * (u.abs() + du) + act.abs() * du + 2 * eps * (act * u).abs() + 1e-5


# (M, I, K, L, R, k, slot pattern): gather (M <= 8) and tile (9..16 rows) forms of the delta,
# and slot bound 1 (k = 1: the LoRA operands are loaded before the K loop)
LORA_SHAPES = [(1, 16, 32, 1, 4, 1, "one"), (5, 50, 70, 3, 5, 3, "mixed"),
               (8, 96, 512, 8, 16, 8, "mixed"), (8, 40, 256, 8, 16, 1, "one"),
               (13, 33, 300, 4, 20, 2, "mixed"), (16, 64, 256, 2, 3, 2, "none"),
               (6, 24, 128, 2, 5, 1, "mixed"), (14, 70, 96, 3, 16, 1, "mixed")]


@ACTS
@pytest.mark.parametrize("M,I,K,L,R,k,pattern", LORA_SHAPES)
def test_skinny_gate_up_silu_lora(M, I, K, L, R, k, pattern, activation):
    x, w, delta, slots = _gate_up_lora(M, I, K, L, R, k, torch.float16, M * 31 + I + R, pattern)
    out = torch.full((M, I), POISON, dtype=torch.float16, device=DEVICE)
    assert skinny_gate_up_silu(x, w, out=out, lora=delta, activation=activation) is out
    # the unfused pair: the GEMM, then act_and_mul's LoRA kernel (the delta forms may sum the
    # R products in another order: an ulp of gate / up apart)
    unfused = act_and_mul(skinny_gemm(x, w, config=SAME_K_STEPS), activation, lora=delta)
    base = ref_linear(x, w)
    gate_up = delta.apply_reference(base)
    ref = ref_act_and_mul(gate_up, activation)
    tol = _act_mul_tol(gate_up, base, torch.float16, activation)
    assert ((out.float() - ref.float()).abs() <= tol).all()
    assert ((out.float() - unfused.float()).abs() <= tol).all()
    none = (slots < 0).nonzero().squeeze(1)  # rows without an adapter: the no-LoRA kernel's values
    assert (torch.equal(out[none], skinny_gate_up_silu(x, w, activation=activation)[none])
            or out.is_cuda)


def test_skinny_gate_up_silu_lora_bad_delta():
    x, w, delta, _ = _gate_up_lora(4, 16, 32, 2, 4, 2, torch.float16, 1, "mixed")
    with pytest.raises(ValueError, match="LoRA delta does not fit"):
        skinny_gate_up_silu(x, w[:30], lora=delta)


def test_bad_args():
    x = torch.randn(17, 8, device=DEVICE, dtype=torch.float16)
    w = torch.randn(4, 8, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="M <= 16"):
        skinny_gemm(x, w)
    with pytest.raises(ValueError, match="fp16/bf16"):
        skinny_gemm(x[:4].float(), w.float())
    with pytest.raises(ValueError, match="2\\*I rows"):
        skinny_gate_up_silu(x[:4], w[:3])
    with pytest.raises(ValueError, match="activation"):
        skinny_gate_up_silu(x[:4], w, activation="gelu")
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(x[:4], w, torch.ones(3, dtype=torch.float16, device=DEVICE))
    assert skinny_gemm(x[:0], w).shape == (0, 4)


# Llama-2-7b (qkv, o, gate_up, down, lm_head) and Llama-3-8b GQA shapes, [N, K]
GPU_SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096),
              (6144, 4096), (28672, 4096), (4096, 14336), (100, 4096)]
# gate_up of Gemma-2-9b, Gemma-3-12b and Gemma-3-27b, [2I, K]
GEMMA_GATE_UP = [(28672, 3584), (30720, 3840), (43008, 5376)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 8, 13, 16])
def test_bf16_gpu_decode_shapes(M):
    for N, K in GPU_SHAPES:
        x, w, g = _operands(M, N, K, torch.bfloat16, seed=M + N + K)
        assert_gemm_close(skinny_gemm(x, w), x, w)
        b = randn(N, dtype=torch.bfloat16, gen=g)
        assert_gemm_close(skinny_gemm(x, w, b), x, w, b)
        if N % 2 == 0:
            fused = skinny_gate_up_silu(x, w)
            assert torch.equal(fused, act_and_mul(skinny_gemm(x, w, config=SAME_K_STEPS))), (N, K)
    for N, K in GEMMA_GATE_UP:
        x, w, g = _operands(M, N, K, torch.bfloat16, seed=M + N + K)
        fused = skinny_gate_up_silu(x, w, activation="gelu_tanh")
        unfused = act_and_mul(skinny_gemm(x, w, config=SAME_K_STEPS), "gelu_tanh")
        assert torch.equal(fused, unfused), (N, K)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [1, 8, 13, 16])
@pytest.mark.parametrize("k", [1, 8])
def test_bf16_gpu_gate_up_lora(M, k):
    # 7b and 8b gate_up (SiLU), Gemma-2-9b and Gemma-3-12b gate_up (GELU-tanh); rank 16, 8 slots
    for I, K, act in [(11008, 4096, "silu"), (14336, 4096, "silu"), (14336, 3584, "gelu_tanh"),
                      (15360, 3840, "gelu_tanh")]:
        x, w, delta, slots = _gate_up_lora(M, I, K, 8, 16, k, torch.bfloat16, M + k + I, "mixed")
        out = skinny_gate_up_silu(x, w, lora=delta, activation=act)
        base = ref_linear(x, w)
        gate_up = delta.apply_reference(base)
        ref = ref_act_and_mul(gate_up, act)
        tol = _act_mul_tol(gate_up, base, torch.bfloat16, act)
        assert ((out.float() - ref.float()).abs() <= tol).all(), (M, k, I, act)
        none = (slots < 0).nonzero().squeeze(1)
        assert torch.equal(out[none], skinny_gate_up_silu(x, w, activation=act)[none]), (M, k, I)
