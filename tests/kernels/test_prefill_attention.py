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


def poison_before_window(seqs, kc, vc, tables, block_size, window):
    """NaN into every cache slot before the first query's window (positions < c - window + 1
    for a sequence of c cached tokens and new ones from position c): no query sees them, so a
    read of any leaks NaN."""
    for b, (cached, _) in enumerate(seqs):
        pos = torch.arange(max(0, cached - window + 1), device=tables.device)
        pages = tables[b, pos // block_size].long()
        kc[pages, pos % block_size] = vc[pages, pos % block_size] = float("nan")


def run_and_check(seqs, Hq, Hkv, D, dtype, gen, block_size=16, window=None, softcap=None,
                  scale=None, tuning=None):
    q, kc, vc, tables, qs, ctx, q_lens = make_inputs(seqs, Hq, Hkv, D, block_size, dtype, gen)
    scale = D ** -0.5 if scale is None else scale
    if window is not None:
        poison_before_window(seqs, kc, vc, tables, block_size, window)
    out = torch.full_like(q, float("nan"))  # every query row must be written
    prefill_attention(q, kc, vc, tables, qs, ctx, max(q_lens), scale, out, window, softcap,
                      tuning=tuning)
    ref = ref_prefill_attention(q, kc.nan_to_num(), vc.nan_to_num(), tables, qs, ctx, scale,
                                sliding_window=window, logit_softcap=softcap)
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


@pytest.mark.parametrize("window,heads", [
    (1, (2, 2)), (5, (4, 1)), (16, (2, 2)), (37, (4, 1)), (100, (2, 2)),
    pytest.param(4096, (4, 1), marks=pytest.mark.slow),
], ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_prefill_attention_sliding_window(window, heads):
    # windows of one key, under a page, a page, off page edges, and longer than every context
    # (the causal result); NaN in every slot before each sequence's first window
    gen = torch.Generator().manual_seed(window + heads[1])
    run_and_check(SEQS, *heads, 64, torch.float32, gen, window=window)


@pytest.mark.parametrize("tuning", [dict(block_m=16, block_n=16), dict(block_m=32, block_n=64),
                                    dict(block_m=64, block_n=32)], ids=["m16n16", "m32n64", "m64n32"])
@pytest.mark.parametrize("window", [3, 40, 200])
def test_prefill_attention_window_tiles(tuning, window):
    # Small tiles put the window's edge tiles, the tiles every row sees whole and the causal
    # diagonal each in play, alone and together, across several query tiles per sequence.
    gen = torch.Generator().manual_seed(window + tuning["block_m"])
    run_and_check([(0, 150), (70, 45), (300, 9), (13, 1)], 4, 2, 64, torch.float32, gen,
                  window=window, tuning=tuning)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window,softcap", [(None, 50.0), (None, 2.0), (24, 30.0)],
                         ids=["cap50", "cap2", "window_cap"])
def test_prefill_attention_softcap(dtype, D, window, softcap):
    # q.k scaled up (2x the usual scale) so scores reach the cap's saturating range
    gen = torch.Generator().manual_seed(D + (window or 0) + (dtype == torch.float16))
    scale = 2.0 * D ** -0.5
    seqs = [(0, 7), (40, 7), (95, 33), (0, 70)]
    out, ref = run_and_check(seqs, 4, 2, D, dtype, gen, window=window, softcap=softcap, scale=scale)
    q, kc, vc, tables, qs, ctx, _ = make_inputs(seqs, 4, 2, D, 16, dtype, torch.Generator().manual_seed(
        D + (window or 0) + (dtype == torch.float16)))
    uncapped = ref_prefill_attention(q, kc.nan_to_num(), vc.nan_to_num(), tables, qs, ctx, scale,
                                     sliding_window=window)
    assert (uncapped.float() - ref.float()).abs().max() > 1e-2  # the cap changes the answer


def test_prefill_attention_window_block_size_32_odd_head_dim():
    gen = torch.Generator().manual_seed(8)
    run_and_check([(31, 2), (0, 70), (33, 31), (100, 40)], 6, 3, 40, torch.float32, gen,
                  block_size=32, window=33, softcap=20.0)


def test_prefill_attention_defaults_are_the_plain_kernel():
    # window None and cap None vs a window past every context (same keys, other constexprs)
    gen = torch.Generator().manual_seed(9)
    q, kc, vc, tables, qs, ctx, q_lens = make_inputs([(40, 7), (0, 70)], 4, 2, 64, 16, torch.float32, gen)
    a, b = torch.empty_like(q), torch.empty_like(q)
    prefill_attention(q, kc, vc, tables, qs, ctx, 70, 0.125, a)
    prefill_attention(q, kc, vc, tables, qs, ctx, 70, 0.125, b, sliding_window=10_000)
    assert torch.equal(a, b)


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
    with pytest.raises(ValueError, match="sliding_window"):
        prefill_attention(q, kc, kc, tables, qs, ctx, 3, 1.0, torch.empty_like(q), sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        prefill_attention(q, kc, kc, tables, qs, ctx, 3, 1.0, torch.empty_like(q), logit_softcap=-1.0)


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


@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", [(128, None), (1000, None), (None, 50.0), (512, 50.0),
                                            (1, None)])
@pytest.mark.parametrize("D", [128, 256])
def test_prefill_attention_bf16_window_softcap(window, softcap, D):
    # Mistral-/Gemma-like shapes in bf16: chunks past the window, prompts shorter and longer
    gen = torch.Generator().manual_seed(D + (window or 0))
    lens = torch.randint(1, 300, (16,), generator=gen).tolist()
    cached = torch.randint(0, 1500, (16,), generator=gen).tolist()
    seqs = [(c if i % 2 else 0, n) for i, (c, n) in enumerate(zip(cached, lens))] + [(0, 1024)]
    run_and_check(seqs, 16, 8, D, torch.bfloat16, gen, window=window, softcap=softcap)
