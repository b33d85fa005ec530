import pytest
import torch

from batchrun.kernels.paged_attention import decode_num_splits, paged_decode_attention
from batchrun.kernels.reference import ref_paged_decode_attention
from kernel_testutils import CPU_DTYPES, DEVICE, assert_attention_close, randn


def make_inputs(lens, Hq, Hkv, D, block_size, dtype, gen, max_blocks=None):
    B = len(lens)
    need = [-(-n // block_size) for n in lens]
    max_blocks = max_blocks or max(max(need), 1) + 1
    num_blocks = sum(need) + 1
    # Pages are shuffled; the last page is poisoned with NaN and every table entry past a
    # sequence's blocks points at it: any read of an unused entry would leak NaN into out.
    poison = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    tables = torch.full((B, max_blocks), poison, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    k_cache = randn(num_blocks, block_size, Hkv, D, dtype=dtype, gen=gen)
    v_cache = randn(num_blocks, block_size, Hkv, D, dtype=dtype, gen=gen)
    # Also poison the unused tail of each last page (slots past context_len).
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    for b, n in enumerate(lens):
        if n % block_size:
            page = int(tables[b, n // block_size])
            k_cache[page, n % block_size:] = float("nan")
            v_cache[page, n % block_size:] = float("nan")
    q = randn(B, Hq, D, dtype=dtype, gen=gen)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE), lens_t


def poison_before_window(kc, vc, tables, lens, block_size, window):
    """NaN into every cache slot a sliding window hides (positions < ctx - window), whole
    pages and the hidden head of the first visible page alike: a read of any leaks NaN."""
    for b, n in enumerate(lens):
        pos = torch.arange(max(0, n - window), device=tables.device)
        pages = tables[b, pos // block_size].long()
        kc[pages, pos % block_size] = vc[pages, pos % block_size] = float("nan")


def run_and_check(lens, Hq, Hkv, D, block_size, dtype, gen, num_splits=None, max_blocks=None,
                  window=None, softcap=None, scale=None, poison_window=False):
    q, kc, vc, tables, lens_t = make_inputs(lens, Hq, Hkv, D, block_size, dtype, gen, max_blocks)
    scale = D ** -0.5 if scale is None else scale
    if poison_window:
        poison_before_window(kc, vc, tables, lens, block_size, window)
    out = torch.full_like(q, float("nan"))   # every row must be written, padding rows with 0
    paged_decode_attention(q, kc, vc, tables, lens_t, scale, out, window, softcap, num_splits=num_splits)
    ref = ref_paged_decode_attention(q, torch.nan_to_num(kc), torch.nan_to_num(vc), tables, lens_t, scale,
                                     sliding_window=window, logit_softcap=softcap)
    assert_attention_close(out, ref, vc, dtype)
    zero_rows = lens_t == 0
    assert (out[zero_rows] == 0).all()
    return (q, kc, vc, tables, lens_t), ref


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_decode_attention(dtype, D, heads):
    gen = torch.Generator().manual_seed(D + heads[1])
    run_and_check([1, 70, 0, 16, 33], *heads, D, 16, dtype, gen)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_block_size_and_splits(block_size, num_splits):
    gen = torch.Generator().manual_seed(block_size + num_splits)
    run_and_check([130, 0, 5, 64, 200], 8, 2, 64, block_size, torch.float16, gen, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_decode_attention_split_kv_odd_contexts(num_splits):
    # Flash-decoding splits over odd contexts: shorter than one tile, than one split's share,
    # one token past a tile, long; empty splits and an empty row must merge to the right answer.
    gen = torch.Generator().manual_seed(num_splits)
    run_and_check([1, 7, 33, 0, 65, 257, 1001], 8, 2, 64, 16, torch.float32, gen,
                  num_splits=num_splits, max_blocks=80)


# Contexts for the window tests: 1 token, shorter than / equal to / past a window of 16 or 37,
# off page edges, an empty row, and one long enough that whole pages fall before every window.
WINDOW_LENS = [1, 70, 0, 16, 33, 37, 38, 130]


@pytest.mark.parametrize("window", [1, 5, 16, 37, 129, 4096])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_decode_attention_sliding_window(window, heads):
    # windows of one key, under a page, exactly a page, off page edges (37, 129) and longer
    # than every context (the plain causal result); NaN in every hidden slot
    gen = torch.Generator().manual_seed(window + heads[1])
    run_and_check(WINDOW_LENS, *heads, 64, 16, torch.float32, gen, window=window, poison_window=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("D", [40, 64, 128])
@pytest.mark.parametrize("window,softcap", [(None, 50.0), (None, 2.0), (21, 30.0), (21, None)],
                         ids=["cap50", "cap2", "window_cap", "window"])
def test_decode_attention_window_softcap_dtypes(dtype, D, window, softcap):
    # q.k scaled up (2x the usual scale) so scores reach the cap's saturating range
    gen = torch.Generator().manual_seed(D + (window or 0))
    scale = 2.0 * D ** -0.5
    (q, kc, vc, tables, lens_t), ref = run_and_check(
        [1, 70, 0, 33, 21, 100], 8, 2, D, 16, dtype, gen, window=window, softcap=softcap,
        scale=scale, poison_window=window is not None)
    if softcap is not None:  # the cap must change the answer, or this test would not see it
        uncapped = ref_paged_decode_attention(q, kc.nan_to_num(), vc.nan_to_num(), tables, lens_t,
                                              scale, sliding_window=window)
        assert (uncapped.float() - ref.float()).abs().max() > 1e-2


@pytest.mark.parametrize("num_splits,window,softcap", [
    (5, 300, None), (3, 1, None), (2, 17, 50.0),
    pytest.param(16, 1, None, marks=pytest.mark.slow),
    pytest.param(16, 1000, 5.0, marks=pytest.mark.slow),
])
def test_decode_attention_window_split_kv(num_splits, window, softcap):
    # Flash-decoding over the visible range only: splits share [ctx - window, ctx), so short
    # windows leave most splits empty and long ones split past page and tile edges.
    gen = torch.Generator().manual_seed(num_splits + window)
    run_and_check([1, 7, 33, 0, 65, 257, 1001], 8, 2, 64, 16, torch.float32, gen,
                  num_splits=num_splits, max_blocks=80, window=window, softcap=softcap,
                  poison_window=True)


def test_decode_attention_window_equals_truncated_context():
    # A window of w over a context of n equals plain attention over the last w keys alone:
    # the same query against its table with the hidden pages dropped.
    gen = torch.Generator().manual_seed(5)
    lens, w, bs = [96, 208], 64, 16  # windows that start on a page edge
    q, kc, vc, tables, lens_t = make_inputs(lens, 8, 2, 64, bs, torch.float32, gen)
    out = torch.empty_like(q)
    paged_decode_attention(q, kc, vc, tables, lens_t, 0.125, out, sliding_window=w)
    shifted = torch.stack([tables[b].roll(-((n - w) // bs)) for b, n in enumerate(lens)])
    plain = torch.empty_like(q)
    w_lens = torch.full_like(lens_t, w)
    paged_decode_attention(q, kc, vc, shifted, w_lens, 0.125, plain)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-5)


def test_decode_attention_defaults_are_the_plain_kernel():
    # window None and cap None vs a window past every context (same keys, other constexprs)
    gen = torch.Generator().manual_seed(6)
    q, kc, vc, tables, lens_t = make_inputs([1, 70, 33], 8, 2, 64, 16, torch.float32, gen)
    a, b = torch.empty_like(q), torch.empty_like(q)
    paged_decode_attention(q, kc, vc, tables, lens_t, 0.125, a)
    paged_decode_attention(q, kc, vc, tables, lens_t, 0.125, b, sliding_window=10_000)
    assert torch.equal(a, b)


def test_tanh_matches_torch():
    # the kernels' tanh, elementwise: within a few ulps of fp64 tanh over small, mid, saturating
    # and infinite arguments, both branches and their edge at |x| = 0.25
    from kernel_tanh import run_tanh
    x = torch.cat([torch.linspace(-30, 30, 4001), torch.linspace(-0.3, 0.3, 2001),
                   torch.tensor([0.0, 1e-30, -1e-30, 1e-8, 0.25, -0.25, 0.2499999, 88.0, -88.0,
                                 1e4, -1e4, float("inf"), float("-inf")])])
    got = run_tanh(x.to(DEVICE)).cpu()
    ref = torch.tanh(x.double())
    rel = (got.double() - ref).abs() / ref.abs().clamp(min=1e-30)
    assert rel.max().item() < 4 * torch.finfo(torch.float32).eps, rel.max().item()


def test_decode_num_splits_heuristic():
    sms = 132  # H200
    # enough (sequence, kv head) programs to fill the GPU twice, or short capacity: no split
    assert decode_num_splits(256 * 32, 4096, sms) == 1
    assert decode_num_splits(2 * sms, 4096, sms) == 1
    assert decode_num_splits(8, 512, sms) == 1
    # small batches, long capacity: ~4 programs per SM, >= 256 tokens per split, at most 16
    assert decode_num_splits(8 * 32, 4096, sms) == 3         # ceil(528 / 256)
    assert decode_num_splits(8 * 8, 4096, sms) == 9
    assert decode_num_splits(32, 4096, sms) == 16
    assert decode_num_splits(8, 1024, sms) == 4              # capacity-bound
    for programs in (1, 7, 64, 263):
        for cap in (1024, 2048, 8192):
            n = decode_num_splits(programs, cap, sms)
            assert 2 <= n <= 16 and cap // n >= 256


def test_decode_attention_gqa8_odd_head_dim():
    # Llama-3-70B-like grouping (8 query heads per kv head); head dim not a power of two.
    gen = torch.Generator().manual_seed(3)
    run_and_check([9, 47], 16, 2, 40, 16, torch.float32, gen)


def test_decode_attention_long_table_short_context():
    # A table sized for max_model_len while contexts are short (the graph-capture case).
    gen = torch.Generator().manual_seed(4)
    run_and_check([3, 17], 4, 4, 64, 16, torch.float32, gen, num_splits=4, max_blocks=64)


def test_decode_attention_rejects_bad_arguments():
    q = torch.randn(2, 6, 32, device=DEVICE)
    kc = torch.randn(4, 16, 4, 32, device=DEVICE)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q, kc, kc, tables, lens, 1.0, torch.empty_like(q))
    q = torch.randn(2, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, kc, kc, tables.long(), lens, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(q, kc, kc, tables, lens, 1.0, torch.empty_like(q).half())
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_attention(q, kc, kc, tables, lens, 1.0, torch.empty_like(q), sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        paged_decode_attention(q, kc, kc, tables, lens, 1.0, torch.empty_like(q), logit_softcap=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64, 256])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8)], ids=["llama2_7b", "llama3_8b"])
def test_decode_attention_bf16_realistic(B, heads):
    gen = torch.Generator().manual_seed(B)
    longest = 2048 if B <= 64 else 512  # keeps the fp32 reference's gathered K/V small
    lens = torch.randint(1, longest, (B,), generator=gen).tolist()
    lens[0] = 0
    if B > 1:
        lens[1] = longest
    run_and_check(lens, *heads, 128, 16, torch.bfloat16, gen, max_blocks=128)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("window,softcap", [(300, None), (1500, None), (4096, 50.0), (None, 50.0),
                                            (1, 30.0)])
def test_decode_attention_bf16_window_softcap(B, window, softcap):
    # Heuristic splits (small B splits the visible range), Gemma-like GQA, bf16; hidden slots NaN
    gen = torch.Generator().manual_seed(B + (window or 0))
    lens = torch.randint(1, 2048, (B,), generator=gen).tolist()
    lens[0] = 0
    if B > 1:
        lens[1] = 2048
    run_and_check(lens, 16, 8, 128, 16, torch.bfloat16, gen, max_blocks=128, window=window,
                  softcap=softcap, poison_window=window is not None)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 100, 1500, 8192])
def test_decode_num_splits_follows_window(monkeypatch, window):
    # The split heuristic sees the most keys a query can see: min(table capacity, window).
    import batchrun.kernels.paged_attention as pa
    seen = []
    real = pa.decode_num_splits
    monkeypatch.setattr(pa, "decode_num_splits", lambda p, c, s: seen.append(c) or real(p, c, s))
    gen = torch.Generator().manual_seed(1)
    q, kc, vc, tables, lens_t = make_inputs([700, 3000], 8, 2, 128, 16, torch.bfloat16, gen,
                                            max_blocks=256)
    out = torch.empty_like(q)
    pa.paged_decode_attention(q, kc, vc, tables, lens_t, 0.1, out, sliding_window=window)
    assert seen == [min(256 * 16, window or 1 << 30)]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 4])
def test_decode_attention_window_graph_replay(num_splits):
    # A captured decode step with a window and a cap follows context lengths rewritten in place.
    from test_graph_capture import capture
    gen = torch.Generator().manual_seed(2)
    dt, B, Hq, Hkv, D, bs, max_blocks, num_blocks = torch.bfloat16, 4, 16, 8, 256, 16, 128, 600
    q = torch.empty(B, Hq, D, dtype=dt, device="cuda")
    kc = randn(num_blocks, bs, Hkv, D, dtype=dt, gen=gen)
    vc = randn(num_blocks, bs, Hkv, D, dtype=dt, gen=gen)
    tables = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, Hq, D, dtype=dt, device="cuda")
    g = capture(lambda: paged_decode_attention(q, kc, vc, tables, lens, 0.0625, out, 1024, 50.0,
                                               num_splits=num_splits))
    for trial in range(3):
        new_lens = torch.randint(0, max_blocks * bs + 1, (B,), generator=gen, dtype=torch.int32)
        new_lens[0] = 0
        tables.copy_(torch.randperm(num_blocks, generator=gen)[:B * max_blocks].view(B, max_blocks))
        lens.copy_(new_lens)
        q.copy_(randn(B, Hq, D, dtype=dt, gen=gen))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = ref_paged_decode_attention(q, kc, vc, tables, lens, 0.0625, 1024, 50.0)
        assert_attention_close(out, ref, vc, dt)
