"""kernels/fused_moe.py against kernels/reference.py's ref_fused_moe: both paths (decode: one
tile of every slot per selected expert; sorted: per-expert blocks from moe_align) over odd
shapes (H, I off the tiles), expert counts 1..60, top-k 1..8, routing that reaches every expert
and routing that leaves most experts empty, both activations, fp32 and fp16 under the Triton
interpreter, fresh random inputs; bf16 at Qwen3-30B-A3B shapes and CUDA-graph replay with new
routing on a GPU."""
import pytest
import torch

from batchrun.kernels.act_and_mul import ACTIVATIONS
from batchrun.kernels.fused_moe import (DECODE_MAX_SLOTS, fused_moe, moe_align, padded_bound,
                                        use_decode_path)
from batchrun.kernels.reference import ref_act_and_mul, ref_fused_moe
from kernel_testutils import DEVICE, randn


def _routing(T, E, k, pattern, gen):
    # (topk_weights fp32 [T, k], topk_ids int [T, k]), k distinct experts a row:
    # "random": top-k of random logits, weights softmax-normalised over the k (Mixtral's way);
    # "every": row t takes experts (t*k + j) % E, so T*k >= E slots reach every expert;
    # "empty": top-k within a random subset of max(k, E // 4) experts, the rest stay empty
    logits = torch.randn(T, E, generator=gen)
    if pattern == "every":
        ids = (torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % E
        weights = logits.gather(1, ids).softmax(-1)
    else:
        if pattern == "empty":
            keep = torch.randperm(E, generator=gen)[:max(k, E // 4)]
            mask = torch.full((E,), float("-inf"))
            mask[keep] = 0.0
            logits = logits + mask
        weights, ids = torch.topk(logits, k, dim=-1)
        weights = weights.softmax(-1)
    return weights.float().to(DEVICE), ids.to(torch.int32 if T % 2 else torch.int64).to(DEVICE)


def _inputs(T, H, I, E, k, dtype, pattern, seed):
    gen = torch.Generator().manual_seed(seed)
    x = randn(T, H, dtype=dtype, gen=gen)
    w_gate_up = randn(E, 2 * I, H, dtype=dtype, gen=gen, scale=H ** -0.5)
    w_down = randn(E, H, I, dtype=dtype, gen=gen, scale=I ** -0.5)
    return x, w_gate_up, w_down, *_routing(T, E, k, pattern, gen)


def _moe_tol(x, w_gate_up, w_down, topk_weights, topk_ids, activation):
    """Elementwise bound on |kernel - reference|, both rounding where the reference does.
    Per expert: gate and up differ by fp32 summation order (in terms of sum |x*w|) and may then
    round an ulp apart (a flip near a tie, an ulp of the value); the activation's slope is
    <= 1.13 for both activations; act, h and the down output may each round an ulp apart; the
    down GEMM and the sum over k add fp32 order differences; the output rounds once."""
    dtype = x.dtype
    T, H = x.shape
    I = w_down.shape[2]
    flip = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0

    def acc(terms):
        return 4 * terms ** 0.5 * torch.finfo(torch.float32).eps

    ids = topk_ids.long()
    bound = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    weighted = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        xf, w = x[tok].float(), w_gate_up[e].float()
        g, u = (xf @ w.t()).chunk(2, dim=-1)
        ga, ua = (xf.abs() @ w.abs().t()).chunk(2, dim=-1)
        dg, du = acc(H) * ga + flip * g.abs(), acc(H) * ua + flip * u.abs()
        act = ref_act_and_mul(torch.cat([g, torch.ones_like(g)], dim=-1), activation)
        dact = 1.13 * dg + flip * act.abs()
        h = act * u
        dh = dact * (u.abs() + du) + act.abs() * du + flip * h.abs()
        wd = w_down[e].float()
        y, dy_in = h @ wd.t(), dh @ wd.abs().t()
        dy = dy_in + acc(I) * ((h.abs() + dh) @ wd.abs().t()) + flip * (y.abs() + dy_in)
        wt = topk_weights[tok, j].float().abs().unsqueeze(1)
        bound.index_add_(0, tok, dy * wt)
        weighted.index_add_(0, tok, (y.abs() + dy) * wt)
    k = ids.shape[1]
    return bound + (acc(k) + flip) * weighted + 1e-6


def _assert_moe_close(out, x, w_gate_up, w_down, topk_weights, topk_ids, activation):
    ref = ref_fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    tol = _moe_tol(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    err = (out.float() - ref.float()).abs()
    assert (err <= tol).all(), (err - tol).max().item()


# (T, H, I, E, k, routing, dtype, activation): H and I off the tiles, E = 1, 3, 8, 60,
# k = 1, 2, 4, 8, T = 1, 5, 33, 200
F32, F16 = torch.float32, torch.float16
DECODE_CASES = [
    (1, 64, 32, 1, 1, "random", F32, "silu"),
    (1, 70, 50, 8, 8, "random", F16, "gelu_tanh"),
    (5, 70, 50, 3, 2, "every", F32, "silu"),
    (5, 100, 40, 60, 8, "empty", F16, "silu"),
    (8, 48, 24, 8, 8, "every", F16, "gelu_tanh"),       # 64 slots: the largest decode tile
    (33, 40, 24, 8, 1, "empty", F32, "gelu_tanh"),
    pytest.param(16, 136, 72, 60, 4, "every", F16, "silu", marks=pytest.mark.slow),  # 64 slots, 60 experts
]
SORTED_CASES = [
    (1, 64, 32, 1, 1, "random", F16, "silu"),
    (5, 70, 50, 3, 2, "every", F16, "gelu_tanh"),
    (33, 100, 40, 8, 4, "empty", F16, "silu"),
    (33, 72, 40, 60, 2, "every", F32, "silu"),
    (33, 40, 24, 3, 3, "random", F32, "gelu_tanh"),
    pytest.param(200, 64, 40, 8, 4, "random", F16, "gelu_tanh", marks=pytest.mark.slow),
    pytest.param(200, 96, 48, 60, 8, "every", F32, "silu", marks=pytest.mark.slow),
    pytest.param(200, 80, 56, 60, 8, "empty", F16, "silu", marks=pytest.mark.slow),
]
CASE = "T,H,I,E,k,routing,dtype,activation"


@pytest.mark.parametrize(CASE, DECODE_CASES)
def test_decode_path(T, H, I, E, k, routing, dtype, activation):
    args = _inputs(T, H, I, E, k, dtype, routing, seed=T * 1000 + H + I + E + k)
    out = fused_moe(*args, activation, path="decode")
    _assert_moe_close(out, *args, activation)


@pytest.mark.parametrize(CASE, SORTED_CASES)
def test_sorted_path(T, H, I, E, k, routing, dtype, activation):
    args = _inputs(T, H, I, E, k, dtype, routing, seed=T * 1000 + H + I + E + k + 1)
    out = fused_moe(*args, activation, path="sorted")
    _assert_moe_close(out, *args, activation)


@pytest.mark.parametrize("path", ["decode", "sorted"])
def test_unselected_experts_are_never_read(path):
    # NaN weights in every expert no row routes to: a path that read them (or computed blocks
    # of empty experts) would put NaN into the output
    x, w_gate_up, w_down, weights, ids = _inputs(6, 40, 24, 8, 2, F16, "empty", seed=11)
    unused = torch.ones(8, dtype=torch.bool)
    unused[ids.long().flatten().cpu()] = False
    assert unused.any()
    poisoned_gu, poisoned_d = w_gate_up.clone(), w_down.clone()
    poisoned_gu[unused.to(DEVICE)] = float("nan")
    poisoned_d[unused.to(DEVICE)] = float("nan")
    out = fused_moe(x, poisoned_gu, poisoned_d, weights, ids, path=path)
    _assert_moe_close(out, x, w_gate_up, w_down, weights, ids, "silu")


def test_default_path_is_the_static_rule():
    assert use_decode_path(8, 8) and use_decode_path(64, 1) and use_decode_path(1, 8)
    assert not use_decode_path(9, 8) and not use_decode_path(33, 2)
    for T, k in [(16, 4), (17, 4)]:
        args = _inputs(T, 40, 24, 8, k, F16, "random", seed=T)
        picked = "decode" if T * k <= DECODE_MAX_SLOTS else "sorted"
        assert torch.equal(fused_moe(*args), fused_moe(*args, path=picked))


@pytest.mark.parametrize("T,E,k,block_m,routing", [(1, 1, 1, 16, "random"), (5, 3, 2, 16, "every"),
                                                   (33, 60, 2, 16, "every"), (200, 8, 4, 64, "random"),
                                                   (200, 60, 8, 32, "empty"), (7, 60, 8, 16, "empty")])
def test_moe_align(T, E, k, block_m, routing):
    _, ids = _routing(T, E, k, routing, torch.Generator().manual_seed(T + E))
    sorted_ids, expert_ids = moe_align(ids, E, block_m)
    M = T * k
    P = padded_bound(M, E, block_m)
    assert sorted_ids.shape == (P,) and P >= M + min(E, M) * (block_m - 1)
    # whole blocks: each program of the sorted path loads BLOCK_M slot ids before it looks at
    # its expert, so a partial last block would read past sorted_ids
    assert P % block_m == 0 and expert_ids.shape == (P // block_m,)
    assert sorted_ids.dtype == expert_ids.dtype == torch.int32
    flat = ids.long().flatten().cpu()
    sids, eids = sorted_ids.long().cpu(), expert_ids.long().cpu()
    real = sids[sids < M]
    assert sorted(real.tolist()) == list(range(M))              # every slot exactly once
    assert ((sids == M) | (sids < M)).all()                     # the rest is padding
    counts = torch.bincount(flat, minlength=E)
    used = int(((counts + block_m - 1) // block_m).sum())       # blocks the runs need
    assert (eids[used:] == -1).all() and (eids[:used] >= 0).all()
    for b in range(used):                                       # a block holds one expert's slots
        rows = sids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < M]
        assert len(rows) and (flat[rows] == eids[b]).all()
        assert rows.tolist() == sorted(rows.tolist())           # slot order within an expert
    assert eids[:used].tolist() == sorted(eids[:used].tolist())
    assert (sids[used * block_m:] == M).all()
    assert set(eids[:used].tolist()) == set(flat.tolist())      # empty experts get no block


def test_bad_args():
    x, w_gate_up, w_down, weights, ids = _inputs(9, 32, 16, 4, 2, F16, "random", seed=2)
    with pytest.raises(ValueError, match="activation"):
        fused_moe(x, w_gate_up, w_down, weights, ids, "gelu")
    with pytest.raises(ValueError, match="w_down"):
        fused_moe(x, w_gate_up, w_down[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="one float dtype"):
        fused_moe(x.float(), w_gate_up, w_down, weights, ids)
    with pytest.raises(ValueError, match="topk_weights fp32"):
        fused_moe(x, w_gate_up, w_down, weights.half(), ids)
    with pytest.raises(ValueError, match="top-k must be in"):
        fused_moe(x, w_gate_up[:1], w_down[:1], weights, ids)
    with pytest.raises(ValueError, match="decode path takes T \\* k <= 64"):
        fused_moe(x.repeat(4, 1), w_gate_up, w_down, weights.repeat(4, 1), ids.repeat(4, 1),
                  path="decode")
    with pytest.raises(ValueError, match="path must be"):
        fused_moe(x, w_gate_up, w_down, weights, ids, path="dense")
    assert fused_moe(x[:0], w_gate_up, w_down, weights[:0], ids[:0]).shape == (0, 32)


# --- GPU: bf16 at Qwen3-30B-A3B's shapes, CUDA-graph replay ---

QWEN3_MOE = dict(H=2048, I=768, E=128, k=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 64, 2048])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bf16_gpu_qwen3_moe_shapes(T, activation):
    s = QWEN3_MOE
    for routing in ("random", "empty"):
        args = _inputs(T, s["H"], s["I"], s["E"], s["k"], torch.bfloat16, routing, seed=T)
        _assert_moe_close(fused_moe(*args, activation), *args, activation)
        if T * s["k"] <= DECODE_MAX_SLOTS:   # the other path at the same shape
            _assert_moe_close(fused_moe(*args, activation, path="sorted"), *args, activation)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 200])
def test_cuda_graph_replay_with_new_routing(T):
    # capture once, then write new x, weights and ids into the captured buffers: each replay
    # equals an eager call on the same inputs, bit for bit (both paths are deterministic)
    H, I, E, k = 512, 256, 60, 4
    x, w_gate_up, w_down, weights, ids = _inputs(T, H, I, E, k, torch.bfloat16, "random", seed=T)
    ids = ids.to(torch.int32)
    held = {}

    def step():
        held["out"] = fused_moe(x, w_gate_up, w_down, weights, ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                                                # compiles the kernels
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(T + 1)
    for routing in ("random", "every", "empty"):
        new_w, new_ids = _routing(T, E, k, routing, gen)
        x.copy_(randn(T, H, dtype=torch.bfloat16, gen=gen))
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        eager = fused_moe(x, w_gate_up, w_down, weights, ids)
        assert torch.equal(held["out"], eager), routing
        _assert_moe_close(held["out"], x, w_gate_up, w_down, weights, ids, "silu")
