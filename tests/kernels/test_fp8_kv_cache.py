"""An e4m3 KV cache in the attention kernels: paged decode and varlen prefill read e4m3 K/V and
apply their scales (k_scale folded into the score scale, v_scale into the output), equal to the
references over the dequantized caches, under the interpreter (fp32/fp16 queries) and on a GPU
(bf16); the rotary kernels write K / k_scale and V / v_scale into an e4m3 cache (GPU only: the
interpreter here rounds fp32 -> e4m3 wrongly on mantissa carry)."""
import pytest
import torch

from batchrun.kernels.paged_attention import paged_decode_attention
from batchrun.kernels.prefill_attention import prefill_attention
from batchrun.kernels.reference import ref_paged_decode_attention, ref_prefill_attention
from kernel_testutils import CPU_DTYPES, DEVICE, assert_attention_close
import test_paged_attention as decode_t
import test_prefill_attention as prefill_t

FP8 = torch.float8_e4m3fn
DTYPES = CPU_DTYPES if DEVICE == "cpu" else [torch.bfloat16, torch.float16]


def _e4m3(cache, scale):
    return (cache.float() / scale).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Hq,Hkv,D,window", [([1, 17, 40], 4, 2, 64, None),
                                                  ([70, 5], 8, 1, 128, 24), ([33], 2, 2, 80, None)])
def test_decode_reads_an_e4m3_cache(dtype, lens, Hq, Hkv, D, window):
    gen = torch.Generator().manual_seed(sum(lens) + D)
    q, kc, vc, tables, ctx = decode_t.make_inputs(lens, Hq, Hkv, D, 16, dtype, gen)
    ks, vs = 0.02, 0.013  # values / scale span most of e4m3's range
    kc8, vc8 = _e4m3(kc * 4, ks), _e4m3(vc * 3, vs)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kc8, vc8, tables, ctx, D ** -0.5, out, window, None, ks, vs)
    deq_k, deq_v = (kc8.float() * ks).nan_to_num(), (vc8.float() * vs).nan_to_num()
    ref = ref_paged_decode_attention(q, deq_k.to(dtype), deq_v.to(dtype), tables, ctx,
                                     D ** -0.5, window)
    want = ref_paged_decode_attention(q, _nan_free(kc8), _nan_free(vc8),
                                      tables, ctx, D ** -0.5, window, None, ks, vs)
    torch.testing.assert_close(ref.float(), want.float(), rtol=0, atol=1e-2)  # the two references
    assert_attention_close(out, want, deq_v, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs,Hq,Hkv,D", [([(0, 7), (30, 20)], 4, 2, 64), ([(16, 33)], 2, 1, 128)])
def test_prefill_reads_an_e4m3_cache(dtype, seqs, Hq, Hkv, D):
    gen = torch.Generator().manual_seed(len(seqs) + D)
    q, kc, vc, tables, qs, ctx, q_lens = prefill_t.make_inputs(seqs, Hq, Hkv, D, 16, dtype, gen)
    ks, vs = 0.01, 0.02
    kc8, vc8 = _e4m3(kc * 2, ks), _e4m3(vc * 3, vs)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, kc8, vc8, tables, qs, ctx, max(q_lens), D ** -0.5, out, None, None, ks, vs)
    want = ref_prefill_attention(q, _nan_free(kc8), _nan_free(vc8), tables, qs, ctx, D ** -0.5,
                                 None, None, ks, vs)
    assert_attention_close(out, want, (vc8.float() * vs).nan_to_num(), dtype)


def _nan_free(cache8):
    return cache8.float().nan_to_num().to(FP8)


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True])
def test_rotary_writes_an_e4m3_cache(lora):
    from batchrun.kernels.rotary import apply_rotary, apply_rotary_into_cache
    from test_rotary import cos_sin_cache
    from test_rotary_into_cache import _inputs, _split
    T, Hq, Hkv, D = 37, 8, 2, 128
    qkv, delta, positions, gen = _inputs(T, Hq, Hkv, D, torch.bfloat16, 5, 3 if lora else 0, 8)
    slots = (torch.randperm(4 * 16, generator=gen)[:T] + 16).to(device=DEVICE, dtype=torch.long)
    kc = torch.zeros(5, 16, Hkv, D, dtype=FP8, device=DEVICE)
    vc = kc.clone()
    cs = cos_sin_cache(D, 512)
    want = qkv.clone()
    wq, wk, wv = _split(want, Hq, Hkv, D)
    apply_rotary(wq, wk, cs, positions, v=wv, lora=delta)
    q, k, v = _split(qkv, Hq, Hkv, D)
    ks, vs = 0.011, 0.007
    apply_rotary_into_cache(q, k, v, cs, positions, kc, vc, slots, lora=delta, k_scale=ks, v_scale=vs)
    flat_k, flat_v = kc.view(-1, Hkv, D)[slots], vc.view(-1, Hkv, D)[slots]
    assert torch.equal(q, wq)
    for got, ref, s in ((flat_k, wk, ks), (flat_v, wv, vs)):
        exp = (ref.float() * (1.0 / s)).clamp(-448, 448).to(FP8)
        assert (got.float() != exp.float()).float().mean() < 1e-3
