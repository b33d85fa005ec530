"""PagedAttention with a sliding window and logit soft-capping, on the CPU path (SDPA with the
window mask, explicit scores when capped) and the Triton path (interpreter on CPU), against the
formula computed directly in fp64 from each sequence's full K/V: score = q.k * scale, then
cap * tanh(score / cap), key j visible to the query at position i iff j <= i and i - j < window,
softmax, @ v. Steps follow a sequence through chunked prefill, a mixed step and decode steps."""
import pytest
import torch

from batchrun.engine.layers.attention import AttnMetadata, PagedAttention, query_start_tensor
from kernel_testutils import DEVICE, randn

Hq, Hkv, D, BS = 4, 2, 64, 16


def direct(q, k, v, first_pos, scale, window, softcap):
    # q: [n, Hq, D] at positions first_pos..; k, v: [N, Hkv, D] at positions 0..N-1 -> fp64 out
    q, k, v = q.double(), k.double().repeat_interleave(Hq // Hkv, 1), v.double().repeat_interleave(Hq // Hkv, 1)
    scores = torch.einsum("qhd,nhd->hqn", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    i = first_pos + torch.arange(q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    visible = (j <= i) & ((i - j < window) if window is not None else True)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqn,nhd->qhd", probs, v)


# (is_prefill, [(sequence, new tokens)], num_decode): sequence 0's prompt in two chunks, then a
# mixed step (sequence 1 decodes while 0's last chunk prefills), then decode steps
STEPS = [
    (True, [(0, 30), (1, 9)], 0),
    (True, [(1, 1), (0, 23)], 1),
    (False, [(0, 1), (1, 1)], 0),
    (False, [(1, 1), (0, 1)], 0),
]


@pytest.mark.parametrize("force", ["0", "1"], ids=["torch", "triton"])
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (7, None), (20, None),
                                            (None, 5.0), (20, 5.0), (16, 50.0)])
def test_layer_window_softcap_matches_formula(monkeypatch, force, window, softcap):
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", force)
    gen = torch.Generator().manual_seed(3 + (window or 0))
    scale = 0.3  # not head_dim ** -0.5 (Gemma's query_pre_attn_scalar), large enough to cap
    layer = PagedAttention(Hq, Hkv, D, scale=scale, sliding_window=window, logit_softcap=softcap)
    assert (layer.scale, layer.sliding_window, layer.logit_softcap) == (scale, window, softcap)
    layer.k_cache = randn(12, BS, Hkv, D, dtype=torch.float32, gen=gen)  # stale, finite
    layer.v_cache = randn(12, BS, Hkv, D, dtype=torch.float32, gen=gen)
    pages = {0: [7, 2, 9, 4], 1: [5, 11]}
    seen_k = {0: torch.empty(0, Hkv, D), 1: torch.empty(0, Hkv, D)}
    seen_v = dict(seen_k)
    for is_prefill, seqs, nd in STEPS:
        ids = [s for s, _ in seqs]
        q_lens = [n for _, n in seqs]
        start = [seen_k[s].shape[0] for s in ids]
        ctx = [c + n for c, n in zip(start, q_lens)]
        slots = [pages[s][p // BS] * BS + p % BS for s, c, n in zip(ids, start, q_lens)
                 for p in range(c, c + n)]
        tables = torch.tensor([pages[s] + [0] * (4 - len(pages[s])) for s in ids], dtype=torch.int32)
        T = sum(q_lens)
        q = randn(T, Hq, D, dtype=torch.float32, gen=gen)
        k = randn(T, Hkv, D, dtype=torch.float32, gen=gen)
        v = randn(T, Hkv, D, dtype=torch.float32, gen=gen)
        meta = AttnMetadata(is_prefill, torch.tensor(slots, device=DEVICE), tables.to(DEVICE),
                            torch.tensor(ctx, dtype=torch.int32, device=DEVICE),
                            query_lens=q_lens if is_prefill else None,
                            context_lens_host=ctx if is_prefill else None,
                            query_start=query_start_tensor(q_lens, DEVICE) if is_prefill else None,
                            num_decode=nd)
        out = layer(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), meta).cpu()
        row = 0
        for s, c, n in zip(ids, start, q_lens):
            seen_k[s] = torch.cat([seen_k[s], k[row:row + n]])
            seen_v[s] = torch.cat([seen_v[s], v[row:row + n]])
            want = direct(q[row:row + n], seen_k[s], seen_v[s], c, scale, window, softcap)
            torch.testing.assert_close(out[row:row + n].double(), want, atol=2e-5, rtol=1e-5)
            row += n


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 10.0), (5, 10.0)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_prefill_half_follows_transformers_eager(window, softcap, dtype):
    # The CPU path in half precision vs transformers' eager attention written out: scores in the
    # model dtype, capped there, the window as an additive mask of the dtype's minimum, softmax in
    # fp32 rounded back, @ v. Same ops, so they agree to a few half ulps.
    from batchrun.engine.layers.attention import _causal_sdpa
    gen = torch.Generator().manual_seed(4)
    nq, nk, offset, scale = 9, 30, 21, 0.4
    q = randn(nq, Hq, D, dtype=dtype, gen=gen, device="cpu")
    k = randn(nk, Hkv, D, dtype=dtype, gen=gen, device="cpu")
    v = randn(nk, Hkv, D, dtype=dtype, gen=gen, device="cpu")
    got = _causal_sdpa(q, k, v, scale, offset, window, softcap)
    q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in
                  (q, k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)))
    w = torch.matmul(q_, k_.transpose(2, 3)) * scale
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    i = offset + torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    visible = (j <= i) & ((j > i - window) if window is not None else True)
    w = w + torch.zeros(nq, nk, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    p = torch.softmax(w, dim=-1, dtype=torch.float32).to(dtype)
    want = torch.matmul(p, v_).squeeze(0).transpose(0, 1)
    tol = 4 * torch.finfo(dtype).eps * v.abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_layer_rejects_bad_window_and_cap():
    with pytest.raises(ValueError, match="sliding_window"):
        PagedAttention(4, 2, 64, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        PagedAttention(4, 2, 64, logit_softcap=0.0)
    assert PagedAttention(4, 2, 64).scale == 64 ** -0.5
