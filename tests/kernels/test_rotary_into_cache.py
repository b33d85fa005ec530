"""The rotary kernels writing this step's K/V into the paged cache (apply_rotary_into_cache)
against the in-place form (apply_rotary, itself tested against the torch reference): q is the
same bit for bit, each token's cache slot holds exactly the in-place k and v (plus their LoRA
delta), the qkv output's k and v are left as they were, and every other cache slot keeps its
poison. Plain and LoRA kernels (both delta forms), MHA/GQA/MQA, odd head dims, partial rotary
(a table of R < D columns: k's pass-through dims reach the cache unchanged), scattered slots
over several blocks, and padding rows that all write the scratch slot 0."""
import pytest
import torch

from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.rotary import apply_rotary, apply_rotary_into_cache
from kernel_testutils import CPU_DTYPES, DEVICE, POISON, mixed_slots, randn
from test_rotary import cos_sin_cache

BLOCK_SIZE = 16


def _inputs(T, Hq, Hkv, D, dtype, seed, L=0, R=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = [Hq * D, Hkv * D, Hkv * D]
    width = sum(sizes) + (3 * L * R if L else 0)
    out = randn(T, width, dtype=dtype, gen=gen)  # one GEMM output: qkv, then shrunk values
    qkv = out[:, :sum(sizes)]
    delta = None
    if L:
        lora_b = randn(L, sum(sizes), R, dtype=dtype, gen=gen, scale=0.1)
        delta = LoRADelta(out[:, sum(sizes):], lora_b, mixed_slots(T, L, gen).to(DEVICE),
                          (0, sizes[0], sizes[0] + sizes[1], sum(sizes)))
    positions = torch.randint(0, 512, (T,), generator=gen).to(DEVICE)
    return qkv, delta, positions, gen


def _split(qkv, Hq, Hkv, D):
    T = qkv.shape[0]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)


def _check(T, Hq, Hkv, D, dtype, seed, L=0, R=0, padding=0, rot=None):
    # R: the LoRA rank; rot: the rotary dim (the table's width), D unless given
    qkv, delta, positions, gen = _inputs(T, Hq, Hkv, D, dtype, seed, L, R)
    num_blocks = 3 + 2 * T // BLOCK_SIZE
    # distinct slots scattered over blocks 1.. (block 0 is the scratch block); the last
    # `padding` rows all write slot 0 of the scratch block, as padded graph rows do
    perm = torch.randperm((num_blocks - 1) * BLOCK_SIZE, generator=gen)[:T] + BLOCK_SIZE
    if padding:
        perm[T - padding:] = 0
    slots = perm.to(device=DEVICE, dtype=torch.long)
    kc = torch.full((num_blocks, BLOCK_SIZE, Hkv, D), POISON, dtype=dtype, device=DEVICE)
    vc = kc.clone()
    cs = cos_sin_cache(D if rot is None else rot, 512)

    want = qkv.clone()
    wq, wk, wv = _split(want, Hq, Hkv, D)
    apply_rotary(wq, wk, cs, positions, v=wv, lora=delta)

    before = qkv.clone()
    q, k, v = _split(qkv, Hq, Hkv, D)
    got_q = apply_rotary_into_cache(q, k, v, cs, positions, kc, vc, slots, lora=delta)
    assert got_q.data_ptr() == q.data_ptr()
    assert torch.equal(q, wq)                                   # q rotated in place, same bits
    assert torch.equal(k, _split(before, Hq, Hkv, D)[1])        # k, v left as they were
    assert torch.equal(v, _split(before, Hq, Hkv, D)[2])
    real = T - padding
    flat_k, flat_v = kc.view(-1, Hkv, D), vc.view(-1, Hkv, D)
    assert torch.equal(flat_k[slots[:real]], wk[:real])
    assert torch.equal(flat_v[slots[:real]], wv[:real])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (flat_k[untouched] == POISON).all() and (flat_v[untouched] == POISON).all()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("T,D", [(1, 32), (5, 64), (19, 80)])
def test_plain(T, D, heads, dtype):
    _check(T, *heads, D, dtype, seed=T + D + heads[0])


def test_plain_with_padding_rows():
    _check(12, 4, 2, 32, torch.float32, seed=3, padding=4)


@pytest.mark.parametrize("gather_max_rows", [0, 10 ** 6], ids=["slot-loop", "gather"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D,L,R", [(1, 4, 4, 32, 1, 16), (6, 8, 2, 64, 3, 5),
                                            (37, 6, 1, 80, 4, 8)])
def test_lora(T, Hq, Hkv, D, L, R, dtype, gather_max_rows, monkeypatch):
    from batchrun.kernels import lora_delta
    monkeypatch.setattr(lora_delta, "GATHER_MAX_ROWS", gather_max_rows)
    _check(T, Hq, Hkv, D, dtype, seed=T + Hq + D, L=L, R=R)


# (T, heads, D, rotary dim): Phi-4-mini's 0.75 and 0.5 of 128, 0.75 of 96 and 64, Phi-2's
# 32 of 80, and R/2 = 15 (odd) of 80
PARTIAL = [(5, (8, 2), 128, 96), (3, (6, 1), 128, 64), (19, (4, 4), 96, 72),
           (5, (8, 2), 64, 48), (7, (8, 2), 80, 32), (4, (6, 2), 80, 30)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,heads,D,rot", PARTIAL)
def test_plain_partial_rotary(T, heads, D, rot, dtype):
    _check(T, *heads, D, dtype, seed=T + D + rot, rot=rot)


@pytest.mark.parametrize("gather_max_rows", [0, 10 ** 6], ids=["slot-loop", "gather"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D,rot,L,R", [(6, 8, 2, 128, 96, 3, 5), (37, 6, 1, 80, 30, 4, 8),
                                                (5, 4, 4, 96, 48, 2, 16)])
def test_lora_partial_rotary(T, Hq, Hkv, D, rot, L, R, dtype, gather_max_rows, monkeypatch):
    from batchrun.kernels import lora_delta
    monkeypatch.setattr(lora_delta, "GATHER_MAX_ROWS", gather_max_rows)
    _check(T, Hq, Hkv, D, dtype, seed=T + Hq + D + rot, L=L, R=R, rot=rot)


def test_lora_with_padding_rows():
    _check(10, 4, 2, 32, torch.float16, seed=4, L=2, R=8, padding=3)


def test_refuses_a_cache_of_another_shape():
    qkv, _, positions, _ = _inputs(3, 4, 2, 32, torch.float32, seed=1)
    q, k, v = _split(qkv, 4, 2, 32)
    cs = cos_sin_cache(32, 512)
    slots = torch.arange(3, device=DEVICE)
    wrong = torch.zeros(2, BLOCK_SIZE, 4, 32, device=DEVICE)   # 4 kv heads, k has 2
    with pytest.raises(ValueError, match="caches must be"):
        apply_rotary_into_cache(q, k, v, cs, positions, wrong, wrong.clone(), slots)
    ok = torch.zeros(2, BLOCK_SIZE, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        apply_rotary_into_cache(q, k, v, cs, positions, ok, ok.clone(), slots[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
@pytest.mark.parametrize("lora", [(0, 0), (1, 16), (8, 16)], ids=["plain", "lora1", "lora8"])
def test_bf16_gpu(T, heads, lora):
    _check(T, *heads, 128, torch.bfloat16, seed=T + heads[1], L=lora[0], R=lora[1],
           padding=min(3, T - 1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("lora", [(0, 0), (1, 16), (8, 16)], ids=["plain", "lora1", "lora8"])
def test_bf16_gpu_partial_rotary(T, lora):
    # Phi-4-mini: 24 q heads, 8 kv heads of 128 dims, rotary dim 96
    _check(T, 24, 8, 128, torch.bfloat16, seed=T + 7, L=lora[0], R=lora[1],
           padding=min(3, T - 1), rot=96)
