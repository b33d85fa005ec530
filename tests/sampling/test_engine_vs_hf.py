"""The engine's stop strings, min_tokens, repetition penalty and logprobs against HF generate
(stop_strings, min_new_tokens, repetition_penalty, output_logits) on a tiny random model (CPU fp32)."""
import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request

PROMPTS = ["hello world", "abc xyz", "tiny model run"]


@pytest.fixture(scope="module")
def setup(char_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    engine = Engine.from_config(EngineConfig(model=char_model, device="cpu", max_model_len=128, max_num_seqs=4))
    hf = AutoModelForCausalLM.from_pretrained(char_model, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(char_model)
    return engine, hf, tok, [tok(p)["input_ids"] for p in PROMPTS]


def hf_generate(hf, prompt, **kw):
    ids = torch.tensor([prompt])
    kw.setdefault("eos_token_id", None)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), out.logits


def ours(engine, prompts, **sp):
    sp.setdefault("ignore_eos", True)
    return engine.generate([Request(i, p, SamplingParams(**sp)) for i, p in enumerate(prompts)])


def test_repetition_penalty_matches_hf(setup):
    engine, hf, _, prompts = setup
    plain = ours(engine, prompts, max_tokens=16)
    got = ours(engine, prompts, max_tokens=16, repetition_penalty=1.8)
    changed = 0
    for p, r, base in zip(prompts, got, plain):
        ref, _ = hf_generate(hf, p, max_new_tokens=16, repetition_penalty=1.8)
        assert r.output_token_ids == ref
        changed += r.output_token_ids != base.output_token_ids
    assert changed, "the penalty changed no output: the test shows nothing"


def test_logprobs_match_hf_logits(setup):
    engine, hf, _, prompts = setup
    got = ours(engine, prompts, max_tokens=8, logprobs=5)
    for p, r in zip(prompts, got):
        ref, logits = hf_generate(hf, p, max_new_tokens=8)
        assert r.output_token_ids == ref
        lps = [step[0].log_softmax(-1) for step in logits]
        assert len(r.logprobs) == len(r.top_logprobs) == 8
        for t, lp, mine, top in zip(ref, lps, r.logprobs, r.top_logprobs):
            assert abs(mine - lp[t].item()) < 1e-4
            vals, ids = lp.topk(5)
            assert [i for i, _ in top] == ids.tolist()
            assert max(abs(v - w) for (_, v), w in zip(top, vals.tolist())) < 1e-4


def test_min_tokens_matches_hf_min_new_tokens(setup):
    engine, hf, _, prompts = setup
    for p in prompts:
        first = ours(engine, [p], max_tokens=12)[0].output_token_ids
        stop = first[0]  # the token greedy picks first: masked until min_tokens, then it may stop
        ref, _ = hf_generate(hf, p, max_new_tokens=12, min_new_tokens=3, eos_token_id=stop)
        r = ours(engine, [p], max_tokens=12, min_tokens=3, stop_token_ids=(stop,))[0]
        assert r.output_token_ids == ref
        assert stop not in r.output_token_ids[:3]
        if r.finish_reason == "stop":
            assert r.output_token_ids[-1] == stop and r.stop_reason == stop


def test_stop_string_spanning_two_tokens_matches_hf(setup):
    engine, hf, tok, prompts = setup
    tested = 0
    for p in prompts:
        free = ours(engine, [p], max_tokens=20)[0]
        text = free.output_text
        stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2] not in text[:i + 1]), None)
        if stop is None:
            continue
        ref, _ = hf_generate(hf, p, max_new_tokens=20, stop_strings=[stop], tokenizer=tok)
        r = ours(engine, [p], max_tokens=20, stop=(stop,))[0]
        assert r.output_token_ids == ref  # the token that completes the match is kept, as HF and vLLM do
        assert (r.finish_reason, r.stop_reason) == ("stop", stop)
        cut = text.index(stop)
        assert r.output_text == text[:cut]
        kept = ours(engine, [p], max_tokens=20, stop=(stop,), include_stop_str_in_output=True)[0]
        assert kept.output_text == text[:cut + 2]
        tested += 1
    assert tested >= 2
