import pytest
import torch

from batchrun.kernels.prefill_attention import prefill_attention
from batchrun.kernels.reference import ref_prefill_attention
from batchrun.engine.layers.attention import AttnMetadata, PagedAttention, query_start_tensor
from kernel_testutils import CPU_DTYPES, DEVICE, assert_attention_close, randn


def make_inputs(seqs, Hq, Hkv, D, block_size, dtype, gen):
    """seqs: (cached, new) token counts per sequence. The cache holds cached + new tokens per
    sequence on shuffled pages (as after PagedAttention writes this step's K/V); unused page
    tails, the spare page and every table entry past a sequence's pages are NaN-poisoned."""
    B = len(seqs)
    ctx = [c + n for c, n in seqs]
    need = [-(-n // block_size) for n in ctx]
    num_blocks = sum(need) + 1
    poison = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = torch.full((B, max(need) + 2), poison, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    kc = randn(num_blocks, block_size, Hkv, D, dtype=dtype, gen=gen)
    vc = randn(num_blocks, block_size, Hkv, D, dtype=dtype, gen=gen)
    kc[poison] = vc[poison] = float("nan")
    for b, n in enumerate(ctx):
        if n % block_size:
            page = int(tables[b, n // block_size])
            kc[page, n % block_size:] = vc[page, n % block_size:] = float("nan")
    q_lens = [n for _, n in seqs]
    q = randn(sum(q_lens), Hq, D, dtype=dtype, gen=gen)
    return (q, kc, vc, tables.to(DEVICE), query_start_tensor(q_lens, DEVICE),
            torch.tensor(ctx, dtype=torch.int32, device=DEVICE), q_lens)


def run_and_check(seqs, Hq, Hkv, D, dtype, gen, block_size=16):
    q, kc, vc, tables, qs, ctx, q_lens = make_inputs(seqs, Hq, Hkv, D, block_size, dtype, gen)
    scale = D ** -0.5
    out = torch.full_like(q, float("nan"))  # every query row must be written
    prefill_attention(q, kc, vc, tables, qs, ctx, max(q_lens), scale, out)
    ref = ref_prefill_attention(q, kc.nan_to_num(), vc.nan_to_num(), tables, qs, ctx, scale)
    assert_attention_close(out, ref, vc, dtype)
    return out, ref


# (cached tokens from earlier chunks, new tokens this step): odd lengths, one-token prompts and
# chunks, chunk boundaries on and off page and tile edges, one sequence with nothing new
SEQS = [(0, 1), (0, 7), (16, 1), (40, 7), (5, 0), (95, 33), (0, 257)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_prefill_attention(dtype, D, heads):
    gen = torch.Generator().manual_seed(D + 10 * heads[1] + (dtype == torch.float16))
    run_and_check(SEQS, *heads, D, dtype, gen)


def test_prefill_attention_block_size_32_odd_head_dim():
    gen = torch.Generator().manual_seed(7)
    run_and_check([(31, 2), (0, 70), (33, 31)], 6, 3, 40, torch.float32, gen, block_size=32)


def test_prefill_attention_is_causal():
    # Changing a later token's K/V must not change an earlier query's output.
    gen = torch.Generator().manual_seed(11)
    q, kc, vc, tables, qs, ctx, q_lens = make_inputs([(20, 30)], 4, 2, 64, 16, torch.float32, gen)
    kc, vc = kc.nan_to_num(), vc.nan_to_num()
    out1 = torch.empty_like(q)
    prefill_attention(q, kc, vc, tables, qs, ctx, 30, 0.125, out1)
    pos = 40                                    # cache position of query row 20 of this chunk
    page, slot = int(tables[0, pos // 16]), pos % 16
    kc[page, slot] += 3.0
    vc[page, slot] -= 3.0
    out2 = torch.empty_like(q)
    prefill_attention(q, kc, vc, tables, qs, ctx, 30, 0.125, out2)
    assert torch.equal(out1[:20], out2[:20])
    assert not torch.equal(out1[20], out2[20])


def test_layer_chunked_prefill_matches_per_sequence_sdpa(monkeypatch):
    # PagedAttention on the Triton path (the kernel) vs the CPU path (per-sequence SDPA) over a
    # prompt prefilled in two chunks alongside a short one: same K/V writes, same outputs.
    Hq, Hkv, D, bs = 8, 2, 64, 16
    outs = {}
    for force in ("0", "1"):
        monkeypatch.setenv("BATCHRUN_FORCE_TRITON", force)
        g = torch.Generator().manual_seed(1)
        layer = PagedAttention(Hq, Hkv, D)
        layer.k_cache = torch.zeros(12, bs, Hkv, D, device=DEVICE)
        layer.v_cache = torch.zeros(12, bs, Hkv, D, device=DEVICE)
        tables = torch.tensor([[3, 7, 1, 9, 0], [5, 2, 0, 0, 0]], dtype=torch.int32, device=DEVICE)
        steps = [((0, 37), (0, 9)), ((37, 63 - 37), (9, 20 - 9))]  # (start, count) per sequence
        res = []
        for step in steps:
            slots, q_lens, ctx = [], [], []
            for b, (start, n) in enumerate(step):
                slots += [int(tables[b, p // bs]) * bs + p % bs for p in range(start, start + n)]
                q_lens.append(n)
                ctx.append(start + n)
            T = sum(q_lens)
            q = randn(T, Hq, D, dtype=torch.float32, gen=g)
            k = randn(T, Hkv, D, dtype=torch.float32, gen=g)
            v = randn(T, Hkv, D, dtype=torch.float32, gen=g)
            meta = AttnMetadata(True, torch.tensor(slots, device=DEVICE), tables,
                                torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
                                query_lens=q_lens, context_lens_host=ctx,
                                query_start=query_start_tensor(q_lens, DEVICE))
            res.append(layer(q, k, v, meta))
        outs[force] = torch.cat(res)
    assert outs["0"].shape == (63 + 20, Hq, D)
    torch.testing.assert_close(outs["1"], outs["0"], atol=2e-6, rtol=1e-5)


def test_prefill_attention_rejects_bad_arguments():
    q = torch.randn(5, 8, 32, device=DEVICE)
    kc = torch.randn(4, 16, 4, 32, device=DEVICE)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([2, 3], dtype=torch.int32, device=DEVICE)
    qs = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="query_start"):
        prefill_attention(q, kc, kc, tables, qs[:2], ctx, 3, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="int32"):
        prefill_attention(q, kc, kc, tables.long(), qs, ctx, 3, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="multiple"):
        prefill_attention(q[:, :6], kc, kc, tables, qs, ctx, 3, 1.0, torch.empty_like(q[:, :6]))
    with pytest.raises(ValueError, match="dtype"):
        prefill_attention(q, kc, kc, tables, qs, ctx, 3, 1.0, torch.empty_like(q).half())


def test_layer_refuses_triton_prefill_without_query_start(monkeypatch):
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    layer = PagedAttention(4, 4, 32)
    layer.k_cache = torch.zeros(2, 16, 4, 32, device=DEVICE)
    layer.v_cache = torch.zeros(2, 16, 4, 32, device=DEVICE)
    meta = AttnMetadata(True, torch.tensor([16, 17], device=DEVICE),
                        torch.tensor([[1]], dtype=torch.int32, device=DEVICE),
                        torch.tensor([2], dtype=torch.int32, device=DEVICE),
                        query_lens=[2], context_lens_host=[2])
    x = torch.randn(2, 4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="query_start"):
        layer(x, x, x, meta)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)], ids=["llama2_7b", "llama3_8b"])
def test_prefill_attention_bf16_realistic(heads):
    gen = torch.Generator().manual_seed(heads[1])
    lens = torch.randint(1, 300, (24,), generator=gen).tolist()
    cached = torch.randint(0, 400, (24,), generator=gen).tolist()
    seqs = [(c if i % 2 else 0, n) for i, (c, n) in enumerate(zip(cached, lens))] + [(0, 1024)]
    run_and_check(seqs, *heads, 128, torch.bfloat16, gen)
