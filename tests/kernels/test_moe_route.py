"""kernels/moe_route.py (a router's softmax, top-k and normalisation in one launch) against
kernels/reference.py ref_moe_route: every family's combination (Mixtral: normalised, fp32;
Qwen3-MoE: per norm_topk_prob, rounded to the model's dtype), realistic and odd expert counts
and top-k, fresh random logits; under the interpreter in fp32 and fp16, on a GPU in bf16 too."""
import pytest
import torch

from batchrun.kernels.moe_route import moe_route
from batchrun.kernels.reference import ref_moe_route
from kernel_testutils import CPU_DTYPES, DEVICE, randn

DTYPES = CPU_DTYPES if DEVICE == "cpu" else CPU_DTYPES + [torch.bfloat16]


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (7, 128, 8), (33, 60, 4), (5, 5, 5), (16, 256, 8),
                                   (3, 3, 1), (9, 1000, 6)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("round_weights", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_route_matches_the_reference(T, E, k, norm, round_weights, dtype):
    g = torch.Generator().manual_seed(T * 1000 + E + k)
    logits = randn(T, E, dtype=dtype, gen=g, scale=2.0)
    round_to = dtype if round_weights else None
    weights, ids = moe_route(logits, k, norm, round_to)
    want_w, want_ids = ref_moe_route(logits, k, norm, round_to)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (T, k)
    # the same experts in the same (descending) order, up to ties: fp16/bf16 logits repeat
    # values, and torch.topk orders equal ones as it likes (the kernel: lower expert first).
    # So: k distinct experts whose probabilities are the reference's, and the same experts
    # wherever the reference's k-th probability is not shared with another expert
    probs = torch.softmax(logits.float(), dim=-1).cpu()
    ids, want_ids = ids.cpu(), want_ids.cpu()
    assert all(len(set(r)) == k for r in ids.tolist())
    assert torch.equal(probs.gather(1, ids), probs.gather(1, want_ids))
    kth = probs.gather(1, want_ids[:, -1:])
    untied = (probs == kth).sum(-1) == 1
    assert untied.any()
    assert torch.equal(ids[untied].sort(-1).values, want_ids[untied].sort(-1).values)
    tol = 2 * torch.finfo(dtype).eps if round_weights else 1e-6
    torch.testing.assert_close(weights.cpu(), want_w.cpu(), rtol=tol, atol=tol)
    if norm and not round_weights:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(T), rtol=1e-6, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_padding_rows_are_fine():
    logits = torch.zeros(2, 8, device=DEVICE)
    logits[0, 5] = logits[0, 2] = 3.0  # a tie: expert 2 first
    weights, ids = moe_route(logits, 3, False, None)
    assert ids[0].tolist()[:2] == [2, 5]
    assert ids[1].tolist() == [0, 1, 2]  # all equal: the lowest experts
    torch.testing.assert_close(weights[1].cpu(), torch.full((3,), 1 / 8))


def test_moe_route_refuses_what_it_cannot_route():
    logits = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, 9, False, None)
    with pytest.raises(ValueError, match="rounds the weights"):
        moe_route(logits, 2, False, torch.float16)
    with pytest.raises(ValueError, match="contiguous rows"):
        moe_route(logits.t(), 2, False, None)
