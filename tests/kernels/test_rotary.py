import pytest
import torch

from batchrun.kernels.reference import ref_rotary
from batchrun.kernels.rotary import apply_rotary
from batchrun.engine.layers.rotary import RotaryEmbedding
from kernel_testutils import CPU_DTYPES, DEVICE, randn


def cos_sin_cache(D, max_pos, scaling=None):
    rope = RotaryEmbedding(D, max_pos, 10000.0, scaling)
    rope.init_cache(DEVICE)
    return rope.cos_sin


def _check(T, Hq, Hkv, D, dtype, seed, max_pos=4096):
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as views of one fused qkv output: token stride (Hq + 2*Hkv) * D
    qkv = randn(T, (Hq + 2 * Hkv) * D, dtype=dtype, gen=gen)
    q_size, kv_size = Hq * D, Hkv * D
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    assert T == 1 or not q.is_contiguous()
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    cs = cos_sin_cache(D, max_pos)
    ref_q, ref_k = ref_rotary(q, cs, positions), ref_rotary(k, cs, positions)
    v_before, q_in, k_in = v.clone(), q.clone(), k.clone()
    got_q, got_k = apply_rotary(q, k, cs, positions)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(v, v_before)                     # v untouched
    # fp16/bf16: every step is a single rounding of an exact fp32 value -> bit-identical.
    # fp32: identical unless the backend contracts mul+add into an fma (GPU): allow a few ulps.
    if dtype == torch.float32:
        tol = 4 * torch.finfo(dtype).eps * (ref_q.abs().max() + 1)
        assert (q - ref_q).abs().max() <= tol and (k - ref_k).abs().max() <= tol
    else:
        _assert_16bit_rotary(q, ref_q, q_in)
        _assert_16bit_rotary(k, ref_k, k_in)


def _assert_16bit_rotary(got, ref, x):
    if not got.is_cuda:  # the interpreter does each step in fp32 with one rounding: exact
        assert torch.equal(got, ref)
        return
    # On the H200 (2026-12-02) bf16/fp16 results differed from torch's by one rounding in a few
    # elements (the backend's fp32 arithmetic inside one kernel vs torch's three kernels):
    # allow one ulp of the 16-bit type, nothing more.
    ulp = torch.finfo(got.dtype).eps  # spacing of 1.0: one ulp relative
    # an intermediate product is of the input's size: one rounding of it is the bound
    scale = ref.float().abs() + x.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - ref.float()).abs() <= ulp * scale).all()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("T", [1, 5])
def test_rotary(T, heads, D, dtype):
    _check(T, *heads, D, dtype, seed=T * 100 + D + heads[0])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_odd_head_dim_and_many_heads(dtype):
    _check(3, 40, 10, 80, dtype, seed=5)     # D/2 = 40: not a power of two; heads > one block


def test_int32_positions_and_matches_layer():
    # the kernel matches what RotaryEmbedding computes (the CPU engine path), incl. llama3 scaling
    gen = torch.Generator().manual_seed(9)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(64, 512, 500000.0, scaling)
    rope.init_cache(DEVICE)
    q = randn(4, 4, 64, dtype=torch.float16, gen=gen)
    k = randn(4, 2, 64, dtype=torch.float16, gen=gen)
    pos = torch.tensor([0, 7, 300, 511], dtype=torch.int32, device=DEVICE)
    want_q = ref_rotary(q, rope.cos_sin, pos)
    want_k = ref_rotary(k, rope.cos_sin, pos)
    q_in, k_in = q.clone(), k.clone()
    apply_rotary(q, k, rope.cos_sin, pos)
    _assert_16bit_rotary(q, want_q, q_in)
    _assert_16bit_rotary(k, want_k, k_in)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (40, 40)])
def test_bf16_gpu(T, heads):
    _check(T, *heads, 128, torch.bfloat16, seed=T + heads[0] + heads[1])
