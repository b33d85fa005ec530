"""kernels/fused_moe.py against kernels/reference.py's ref_fused_moe: both paths (decode: one
tile of every slot per selected expert; sorted: per-expert blocks from moe_align) over odd
shapes (H, I off the tiles), expert counts 1..60, top-k 1..8, routing that reaches every expert
and routing that leaves most experts empty, both activations, fp32 and fp16 under the Triton
interpreter, fresh random inputs; fused_moe_lora against ref_fused_moe_lora the same way; bf16
at Qwen3-30B-A3B shapes and CUDA-graph replay with new routing (and adapter slots) on a GPU."""
import pytest
import torch

from batchrun.kernels.act_and_mul import ACTIVATIONS
from batchrun.kernels.fused_moe import (DECODE_MAX_SLOTS, fused_moe, fused_moe_lora, moe_align,
                                        padded_bound, use_decode_path)
from batchrun.kernels.reference import ref_act_and_mul, ref_fused_moe, ref_fused_moe_lora
from kernel_testutils import DEVICE, mixed_slots, randn


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


def _acc(terms):
    # fp32 summation-order difference over `terms` products, relative to sum |a*b|
    return 4 * terms ** 0.5 * torch.finfo(torch.float32).eps


def _linear_bound(v, dv, w, flip, lora=None):
    """(y, dy): y = v @ w.T in fp32 from the reference's input values v [n, K], and a bound on
    |kernel - reference| after both round y to the dtype, where the kernel's input may differ
    from v by dv: the input difference carried through |w|, fp32 summation order, and a flip
    of the rounding near a tie (an ulp of the value). lora = (A [n, R, K], B [n, N, R]), each
    row's own adapter's (zeros for rows without one): the delta rnd(v . A) @ B.T is added to
    the rounded base in fp32 and the sum rounded once more."""
    K = v.shape[1]
    va = v.abs() + dv
    y = v @ w.t()
    carried = dv @ w.abs().t()
    dy = carried + _acc(K) * (va @ w.abs().t()) + flip * (y.abs() + carried)
    if lora is not None:
        a, b = lora
        s = torch.einsum("nk,nrk->nr", v, a)
        s_carried = torch.einsum("nk,nrk->nr", dv, a.abs())
        ds = s_carried + _acc(K) * torch.einsum("nk,nrk->nr", va, a.abs()) + \
            flip * (s.abs() + s_carried)
        d = torch.einsum("nr,nmr->nm", s, b)
        dd = torch.einsum("nr,nmr->nm", ds, b.abs()) + \
            _acc(b.shape[2]) * torch.einsum("nr,nmr->nm", s.abs() + ds, b.abs())
        y = y + d
        dy = dy + dd + flip * (y.abs() + dy + dd)
    return y, dy


def _moe_tol(x, w_gate_up, w_down, topk_weights, topk_ids, activation, lora=None):
    """Elementwise bound on |kernel - reference|, both rounding where the reference does: per
    expert the gate_up and down projections within _linear_bound; the activation's slope is
    <= 1.13 for both activations and act and h may each round an ulp apart; the sum over k
    adds fp32 order differences, and the output rounds once. lora: (A_gu, B_gu, A_d, B_d,
    token_slots) as fused_moe_lora takes them."""
    dtype = x.dtype
    T, H = x.shape
    flip = torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    ids = topk_ids.long()
    bound = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    weighted = torch.zeros(T, H, dtype=torch.float32, device=x.device)

    def rows_lora(a, b, e, tok):
        if lora is None:
            return None
        slot = lora[4][:T].long()[tok]
        has = (slot >= 0).float()
        own = slot.clamp(min=0)
        return (a[own, e].float() * has[:, None, None], b[own, e].float() * has[:, None, None])

    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        v = x[tok].float()
        gu, dgu = _linear_bound(v, torch.zeros_like(v), w_gate_up[e].float(), flip,
                                rows_lora(lora[0], lora[1], e, tok) if lora else None)
        (g, u), (dg, du) = gu.chunk(2, dim=-1), dgu.chunk(2, dim=-1)
        act = ref_act_and_mul(torch.cat([g, torch.ones_like(g)], dim=-1), activation)
        dact = 1.13 * dg + flip * act.abs()
        h = act * u
        dh = dact * (u.abs() + du) + act.abs() * du + flip * h.abs()
        y, dy = _linear_bound(h, dh, w_down[e].float(), flip,
                              rows_lora(lora[2], lora[3], e, tok) if lora else None)
        wt = topk_weights[tok, j].float().abs().unsqueeze(1)
        bound.index_add_(0, tok, dy * wt)
        weighted.index_add_(0, tok, (y.abs() + dy) * wt)
    return bound + (_acc(ids.shape[1]) + flip) * weighted + 1e-6


def _assert_moe_close(out, x, w_gate_up, w_down, topk_weights, topk_ids, activation, lora=None):
    if lora is None:
        ref = ref_fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    else:
        ref = ref_fused_moe_lora(x, w_gate_up, w_down, topk_weights, topk_ids, *lora, activation)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    tol = _moe_tol(x, w_gate_up, w_down, topk_weights, topk_ids, activation, lora)
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


@pytest.mark.parametrize("path", ["decode", "sorted"])
def test_strided_inputs(path):
    # x rows with a stride past H, topk_weights a column slice, topk_ids transposed storage:
    # the launcher follows the strides (the ids are flattened to slot order)
    T, H, I, E, k = 6, 40, 24, 8, 3
    x, w_gate_up, w_down, weights, ids = _inputs(T, H, I, E, k, F16, "every", seed=21)
    wide = torch.cat([x, x[:, :5]], dim=1)[:, :H]
    w_cols = torch.cat([weights, weights], dim=1)[:, :k]
    ids_t = ids.t().contiguous().t()
    assert not (wide.is_contiguous() or w_cols.is_contiguous() or ids_t.is_contiguous())
    out = fused_moe(wide, w_gate_up, w_down, w_cols, ids_t, path=path)
    assert torch.equal(out, fused_moe(x, w_gate_up, w_down, weights, ids, path=path))
    _assert_moe_close(out, x, w_gate_up, w_down, weights, ids, "silu")


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


# --- expert LoRA (fused_moe_lora) ---

def _lora(T, H, I, E, L, R, dtype, pattern, seed):
    # (A_gu [L, E, R, H], B_gu [L, E, 2I, R], A_d [L, E, R, I], B_d [L, E, H, R], token_slots):
    # slots "mixed" (-1 and every slot, shuffled), "one" (every token slot L - 1), "none" (-1);
    # token_slots is longer than T, as the engine's preallocated buffer
    gen = torch.Generator().manual_seed(seed)
    weights = (randn(L, E, R, H, dtype=dtype, gen=gen, scale=H ** -0.5),
               randn(L, E, 2 * I, R, dtype=dtype, gen=gen, scale=R ** -0.5),
               randn(L, E, R, I, dtype=dtype, gen=gen, scale=I ** -0.5),
               randn(L, E, H, R, dtype=dtype, gen=gen, scale=R ** -0.5))
    if pattern == "mixed":
        slots = mixed_slots(T, L, gen)
    else:
        slots = torch.full((T,), L - 1 if pattern == "one" else -1, dtype=torch.int32)
    return (*weights, torch.cat([slots, torch.full((3,), L - 1, dtype=torch.int32)]).to(DEVICE))


# (T, H, I, E, k, L, R, slots, path, dtype, activation): ranks off 16 and above it (R = 20:
# BLOCK_R 32), one slot and several, tokens without an adapter mixed in
LORA_CASES = [
    (1, 64, 32, 3, 2, 1, 4, "one", "decode", F32, "silu"),
    (7, 70, 40, 8, 2, 3, 5, "mixed", "decode", F16, "gelu_tanh"),
    (16, 48, 24, 8, 4, 4, 20, "mixed", "decode", F16, "silu"),
    pytest.param(16, 48, 24, 60, 4, 4, 20, "mixed", "decode", F16, "silu", marks=pytest.mark.slow),
    (9, 40, 24, 8, 4, 2, 16, "none", "decode", F16, "silu"),
    (7, 70, 40, 8, 2, 3, 5, "mixed", "sorted", F32, "gelu_tanh"),
    (33, 48, 40, 8, 4, 4, 16, "mixed", "sorted", F16, "silu"),
    (33, 40, 24, 3, 3, 1, 1, "one", "sorted", F16, "gelu_tanh"),
    pytest.param(200, 64, 40, 60, 8, 4, 20, "mixed", "sorted", F16, "silu", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("T,H,I,E,k,L,R,slots,path,dtype,activation", LORA_CASES)
def test_fused_moe_lora(T, H, I, E, k, L, R, slots, path, dtype, activation):
    seed = T * 100 + H + I + E + k + L + R
    args = _inputs(T, H, I, E, k, dtype, "every" if T * k >= E else "random", seed=seed)
    lora = _lora(T, H, I, E, L, R, dtype, slots, seed=seed + 1)
    out = fused_moe_lora(*args, *lora, activation, path=path)
    _assert_moe_close(out, *args, activation, lora)
    # tokens without an adapter get exactly fused_moe's values (on CPU, where both run the
    # same numpy sums; a GPU compiles the LoRA variant on its own)
    none = (lora[4][:T] < 0).nonzero().squeeze(1)
    plain = fused_moe(*args, activation, path=path)
    assert torch.equal(out[none], plain[none]) or out.is_cuda
    if slots != "none":
        assert not torch.equal(out, plain)


def test_fused_moe_lora_bad_args():
    T, H, I, E, k, L, R = 5, 32, 16, 4, 2, 2, 4
    args = _inputs(T, H, I, E, k, F16, "random", seed=3)
    a_gu, b_gu, a_d, b_d, slots = _lora(T, H, I, E, L, R, F16, "mixed", seed=4)
    with pytest.raises(ValueError, match="lora_b_gate_up must be a contiguous \\[2, 4, 32, 4\\]"):
        fused_moe_lora(*args, a_gu, b_gu[:, :, :16], a_d, b_d, slots)
    with pytest.raises(ValueError, match="lora_a_down must be"):
        fused_moe_lora(*args, a_gu, b_gu, a_d.float(), b_d, slots)
    with pytest.raises(ValueError, match="lora_b_down must be"):
        fused_moe_lora(*args, a_gu, b_gu, a_d, b_d[:1], slots)             # other slot count
    strided = a_gu.transpose(2, 3).contiguous().transpose(2, 3)             # same shape
    with pytest.raises(ValueError, match="lora_a_gate_up must be a contiguous"):
        fused_moe_lora(*args, strided, b_gu, a_d, b_d, slots)
    with pytest.raises(ValueError, match="token_slots must be"):
        fused_moe_lora(*args, a_gu, b_gu, a_d, b_d, slots[:T - 1])
    with pytest.raises(ValueError, match="lora_a_gate_up must be \\[L, E, R, H\\]"):
        fused_moe_lora(*args, a_gu[0], b_gu, a_d, b_d, slots)


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
@pytest.mark.parametrize("T", [8, 256])
def test_bf16_gpu_qwen3_moe_lora(T):
    s = QWEN3_MOE
    args = _inputs(T, s["H"], s["I"], s["E"], s["k"], torch.bfloat16, "random", seed=T)
    lora = _lora(T, s["H"], s["I"], s["E"], 4, 16, torch.bfloat16, "mixed", seed=T + 1)
    _assert_moe_close(fused_moe_lora(*args, *lora), *args, "silu", lora)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 200])
@pytest.mark.parametrize("with_lora", [False, True])
def test_cuda_graph_replay_with_new_routing(T, with_lora):
    # capture once, then write new x, weights, ids (and adapter slots) into the captured
    # buffers: each replay equals an eager call on the same inputs, bit for bit (both paths
    # are deterministic), and the reference within rounding
    H, I, E, k, L, R = 512, 256, 60, 4, 3, 16
    x, w_gate_up, w_down, weights, ids = _inputs(T, H, I, E, k, torch.bfloat16, "random", seed=T)
    ids = ids.to(torch.int32)
    lora = _lora(T, H, I, E, L, R, torch.bfloat16, "mixed", seed=T + 2) if with_lora else None
    held = {}

    def call():
        if lora is None:
            return fused_moe(x, w_gate_up, w_down, weights, ids)
        return fused_moe_lora(x, w_gate_up, w_down, weights, ids, *lora)

    def step():
        held["out"] = call()

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
        if lora is not None:
            lora[4][:T].copy_(mixed_slots(T, L if routing != "empty" else 0, gen))
        graph.replay()
        assert torch.equal(held["out"], call()), routing
        _assert_moe_close(held["out"], x, w_gate_up, w_down, weights, ids, "silu", lora)
