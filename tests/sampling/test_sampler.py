"""The vectorised sampler on hand-made logits: penalties as the torch formula says, min_tokens,
logprobs, greedy == argmax, top-k/top-p paths, and the counter-based noise."""
import math

import pytest
import torch

from batchrun.engine.config import SamplingParams
from batchrun.engine.sampler import RowState, _filtered_probs, _top_k_top_p_sorted, exponential_noise, sample

V = 11


def row(prompt=(1, 2), out=(), seed=0, **sp):
    return RowState(SamplingParams(max_tokens=32, **sp), seed, list(prompt) + list(out), len(prompt))


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    out = sample(logits, [row(), row(logprobs=3), row(logprobs=0)])
    assert out.tokens == logits.argmax(-1).tolist()
    lp = logits.log_softmax(-1)
    assert out.logprobs[0] is None and out.top_logprobs[0] is None
    assert out.logprobs[1] == pytest.approx(lp[1, out.tokens[1]].item(), abs=1e-6)
    vals, ids = lp[1].topk(3)
    assert [t for t, _ in out.top_logprobs[1]] == ids.tolist()
    assert [v for _, v in out.top_logprobs[1]] == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.top_logprobs[2] == []


def test_penalties_follow_the_vllm_formula():
    torch.manual_seed(1)
    logits = torch.randn(1, V) * 3
    prompt, output = [1, 2, 2], [3, 3, 4]
    r = row(prompt, output, repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3, logprobs=V)
    ref = logits.clone()[0]
    for t in set(prompt + output):  # repetition: prompt + output, divide positive, multiply negative
        ref[t] = ref[t] / 1.7 if ref[t] > 0 else ref[t] * 1.7
    for t in set(output):  # frequency (per occurrence) and presence (once): output tokens only
        ref[t] -= 0.3 * output.count(t) + 0.5
    out = sample(logits, [r])
    assert out.tokens == [int(ref.argmax())]
    # logprobs are of the raw logits (vLLM's raw_logprobs, HF's output_logits)
    assert dict(out.top_logprobs[0])[5] == pytest.approx(logits.log_softmax(-1)[0, 5].item(), abs=1e-6)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 5.0, 4.0] + [-10.0] * (V - 3)])
    assert sample(logits, [row(prompt=[7])]).tokens == [1]
    assert sample(logits, [row(prompt=[1], repetition_penalty=2.0)]).tokens == [2]  # 5/2 < 4


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0  # EOS
    logits[0, 5] = 9.0  # a stop token id
    short = row(out=[7], min_tokens=3, stop_token_ids=(5,))
    assert sample(logits, [short], eos_ids={2}).tokens[0] not in (2, 5)
    reached = row(out=[7, 7, 7], min_tokens=3, stop_token_ids=(5,))
    assert sample(logits, [reached], eos_ids={2}).tokens == [2]
    ignore = row(out=[7], min_tokens=3, ignore_eos=True, stop_token_ids=(5,))
    assert sample(logits, [ignore], eos_ids={2}).tokens == [2]  # ignore_eos: EOS is not a stop, not masked


def test_top_k_threshold_path_equals_sorted_path():
    torch.manual_seed(2)
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=0.7, top_k=k) for k in (1, 3, 5, V)]
    got = _filtered_probs(logits.clone(), params)
    scaled = logits / 0.7
    ref = _top_k_top_p_sorted(scaled, torch.tensor([1, 3, 5, V]), torch.ones(4)).softmax(-1)
    assert torch.allclose(got, ref, atol=1e-6)


def test_top_p_keeps_smallest_prefix():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = _filtered_probs(logits.clone(), [SamplingParams(temperature=1.0, top_p=0.8)])
    assert (probs[0] > 0).tolist() == [True, True, False, False]


def test_noise_is_a_pure_function_of_seed_step_token():
    seeds = torch.tensor([3, 3, 4], dtype=torch.int64)
    steps = torch.tensor([0, 1, 0], dtype=torch.int64)
    a = exponential_noise(seeds, steps, 1000)
    b = exponential_noise(seeds[[2, 0]], steps[[2, 0]], 1000)
    assert torch.equal(a[2], b[0]) and torch.equal(a[0], b[1])  # batch-mates do not matter
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and abs(a.mean().item() - 1.0) < 0.1  # Exp(1): mean 1


def test_sampled_frequencies_follow_the_distribution():
    p = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(p)[None].repeat(4000, 1)
    rows = [RowState(SamplingParams(temperature=1.0), seed, [1], 1) for seed in range(4000)]
    toks = torch.tensor(sample(logits, rows).tokens)
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, p, atol=0.03), freq
    again = sample(logits[:50], rows[:50]).tokens
    assert again == toks[:50].tolist()
