"""The rotary kernel (in place, no LoRA) against the torch reference, full and partial rotary
(a cos/sin table of R < D columns: dims R.. pass through), and the reference's partial rotary
against transformers' own apply_rotary_pos_emb (Phi-3)."""
import pytest
import torch

from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.reference import ref_rotary
from batchrun.kernels.rotary import apply_rotary
from batchrun.engine.layers.attention import KVWrite
from batchrun.engine.layers.rotary import RotaryEmbedding
from kernel_testutils import CPU_DTYPES, DEVICE, mixed_slots, randn


def cos_sin_cache(R, max_pos, scaling=None):
    # fp32 [max_pos, R]: the table of a rotary dim R (the head dim, or less for partial rotary:
    # its R/2 frequencies are those of a head of R dims, as transformers computes them)
    rope = RotaryEmbedding(R, max_pos, 10000.0, scaling)
    rope.init_cache(DEVICE)
    return rope.cos_sin


def rotary_dim(D, factor):
    # transformers: int(head_dim * partial_rotary_factor)
    R = int(D * factor)
    assert R % 2 == 0
    return R


def _check(T, Hq, Hkv, D, dtype, seed, max_pos=4096, R=None):
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as views of one fused qkv output: token stride (Hq + 2*Hkv) * D
    qkv = randn(T, (Hq + 2 * Hkv) * D, dtype=dtype, gen=gen)
    q_size, kv_size = Hq * D, Hkv * D
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
    assert T == 1 or not q.is_contiguous()
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(DEVICE)
    R = D if R is None else R
    cs = cos_sin_cache(R, max_pos)
    ref_q, ref_k = ref_rotary(q, cs, positions), ref_rotary(k, cs, positions)
    v_before, q_in, k_in = v.clone(), q.clone(), k.clone()
    got_q, got_k = apply_rotary(q, k, cs, positions)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(v, v_before)                     # v untouched
    # partial rotary: the pass-through dims keep their bits
    assert torch.equal(q[..., R:], q_in[..., R:]) and torch.equal(k[..., R:], k_in[..., R:])
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


# Partial rotary: head dims 64, 96, 128 at factors 1, 0.75 (Phi-4-mini), 0.5; D = 80 at 0.4
# (Phi-2: R = 32) and R = 30 (R/2 = 15 odd, D/2 = 40 not a power of two: the rotary and the
# pass-through columns share a padded block unevenly)
PARTIAL = [(D, rotary_dim(D, f)) for D in (64, 96, 128) for f in (1.0, 0.75, 0.5)] + \
          [(80, 32), (80, 30)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("D,R", PARTIAL, ids=[f"D{D}-R{R}" for D, R in PARTIAL])
def test_partial_rotary(D, R, dtype):
    _check(5, 8, 2, D, dtype, seed=D + R, R=R)              # GQA, strided views of one qkv


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_partial_rotary_mqa_one_token(dtype):
    _check(1, 6, 1, 96, dtype, seed=3, R=72)


def test_refuses_a_table_wider_than_the_head_or_of_odd_width():
    gen = torch.Generator().manual_seed(1)
    q, k = randn(2, 4, 32, dtype=torch.float32, gen=gen), randn(2, 2, 32, dtype=torch.float32, gen=gen)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    for width in (34, 15):
        with pytest.raises(ValueError, match="rotary dim"):
            apply_rotary(q, k, randn(8, width, dtype=torch.float32, gen=gen), pos)


@pytest.mark.parametrize("D,R", [(64, 48), (96, 72), (128, 96), (128, 64), (80, 32), (64, 64)])
def test_ref_rotary_matches_transformers_partial_rotary(D, R):
    # transformers' Phi-3 apply_rotary_pos_emb with cos/sin of R columns (the R/2 frequencies
    # twice), on q [T, H, D] and k [T, Hkv, D] (unsqueeze_dim=1 broadcasts cos [T, R] over heads):
    # the same fp32 bits
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(D + R)
    T = 7
    q, k = randn(T, 8, D, dtype=torch.float32, gen=gen), randn(T, 2, D, dtype=torch.float32, gen=gen)
    positions = torch.randint(0, 512, (T,), generator=gen).to(DEVICE)
    cs = cos_sin_cache(R, 512)
    cos, sin = cs[positions].chunk(2, dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    assert torch.equal(ref_rotary(q, cs, positions), want_q)
    assert torch.equal(ref_rotary(k, cs, positions), want_k)
    assert not torch.equal(want_q[..., :R], q[..., :R])    # rotated where it should be


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("cache", [False, True], ids=["in-place", "into-cache"])
def test_layer_with_a_partial_table(cache, lora, dtype, monkeypatch):
    # RotaryEmbedding given a table of R < D columns (what a partial_rotary_factor model's
    # table is): its CPU path (ref_rotary) and its Triton path (the kernels, under the
    # interpreter: BATCHRUN_FORCE_TRITON) give the same q and k, with and without the LoRA
    # delta and the cache write
    T, Hq, Hkv, D, R, L, rank = 6, 6, 2, 64, 48, 2, 5
    gen = torch.Generator().manual_seed(11 + 2 * cache + lora)
    rope = RotaryEmbedding(D, 256, 10000.0, None)
    rope.cos_sin = cos_sin_cache(R, 256)
    sizes = [Hq * D, Hkv * D, Hkv * D]
    out = randn(T, sum(sizes) + 3 * L * rank, dtype=dtype, gen=gen)
    delta = None
    if lora:
        lora_b = randn(L, sum(sizes), rank, dtype=dtype, gen=gen, scale=0.1)
        delta = LoRADelta(out[:, sum(sizes):], lora_b, mixed_slots(T, L, gen).to(DEVICE),
                          (0, sizes[0], sizes[0] + sizes[1], sum(sizes)))
    positions = torch.randint(0, 256, (T,), generator=gen).to(DEVICE)

    def split(qkv):
        return (t.view(T, -1, D) for t in qkv.split(sizes, dim=-1))

    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "0")
    want_q, want_k, want_v = rope(positions, *split(out[:, :sum(sizes)].clone()), lora=delta)
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    q, k, v = split(out[:, :sum(sizes)])
    if not cache:
        got_q, got_k, got_v = rope(positions, q, k, v, lora=delta)
    else:
        kc = torch.full((2, 8, Hkv, D), 1e4, dtype=dtype, device=DEVICE)
        vc = kc.clone()
        slots = torch.randperm(16, generator=gen)[:T].to(DEVICE)
        got_q, none_k, none_v = rope(positions, q, k, v, lora=delta, cache=KVWrite(kc, vc, slots))
        assert none_k is None and none_v is None
        got_k, got_v = kc.view(-1, Hkv, D)[slots], vc.view(-1, Hkv, D)[slots]
    if dtype == torch.float16 and lora:
        # the delta: fp32 sums in another order than the reference GEMM's, then rounded
        for got, want in ((got_q, want_q), (got_k, want_k), (got_v, want_v)):
            pair = want.float().abs() + want.float().abs().roll(R // 2, dims=-1)
            assert (got.float() - want.float()).abs().le(2 * torch.finfo(dtype).eps * pair + 1e-3).all()
        return
    atol = 1e-5 if lora else 0      # fp32 LoRA: summation order of the delta
    torch.testing.assert_close(got_q, want_q, rtol=0, atol=atol)
    torch.testing.assert_close(got_k, want_k, rtol=0, atol=atol)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (40, 40)])
def test_bf16_gpu(T, heads):
    _check(T, *heads, 128, torch.bfloat16, seed=T + heads[0] + heads[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("D,R", [(128, 96), (128, 64), (96, 72), (80, 32)])
def test_bf16_gpu_partial(T, D, R):
    _check(T, 24, 8, D, torch.bfloat16, seed=T + D + R, R=R)   # Phi-4-mini: 24 q, 8 kv heads
