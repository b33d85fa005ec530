"""Batch invariance, preemption by recompute, chunked prefill (CPU fp32)."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.envs import Experiments
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from tests.helpers.models import random_prompts, save_hf_model

NEW = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "llama3_gqa"
    save_hf_model("llama3_gqa", d, seed=3)
    return str(d)


def run(model_dir, prompts, **cfg):
    engine = Engine.from_config(EngineConfig(model=model_dir, device="cpu", max_model_len=256,
                                             **cfg))
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    res = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    return [r.output_token_ids for r in res], engine


def test_batch_of_17_mixed_lengths_equals_alone(model_dir):
    prompts = random_prompts(17, [1, 5, 12, 40, 77, 130, 2, 9, 64], 211, seed=5)
    batched, _ = run(model_dir, prompts, max_num_seqs=17, max_num_batched_tokens=128)
    for i in (0, 3, 5, 16):
        alone, _ = run(model_dir, [prompts[i]], max_num_seqs=1)
        assert batched[i] == alone[0], f"row {i}"


def test_preemption_and_chunked_prefill_keep_outputs(model_dir):
    prompts = random_prompts(17, [1, 5, 12, 40, 77, 130, 2, 9, 64], 211, seed=5)
    ref, _ = run(model_dir, prompts, max_num_seqs=17, max_num_batched_tokens=256)
    # 16 usable blocks of 16 tokens = 256 tokens of KV for 17 rows: forces preemption;
    # a 48-token budget prefills the 130-token prompt in 3 chunks
    tight, engine = run(model_dir, prompts, max_num_seqs=17, max_num_batched_tokens=48,
                        experiments=Experiments(num_kv_blocks=17))
    assert engine.stats["preemptions"] > 0
    assert tight == ref


def test_sampling_seed_is_batch_independent(model_dir):
    prompts = random_prompts(9, [4, 30, 11], 211, seed=9)
    engine = Engine.from_config(EngineConfig(model=model_dir, device="cpu", max_model_len=256))
    sp = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234,
                        ignore_eos=True)
    alone = engine.generate([Request(0, prompts[0], sp)])[0].output_token_ids
    mixed = [Request(i, p, SamplingParams(max_tokens=24, temperature=1.3, seed=i, ignore_eos=True))
             for i, p in enumerate(prompts)]
    mixed[4] = Request(4, prompts[0], sp)
    assert engine.generate(mixed)[4].output_token_ids == alone
    again = engine.generate([Request(0, prompts[0], sp)])[0].output_token_ids
    assert again == alone
    other = engine.generate([Request(0, prompts[0], SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True))])
    assert other[0].output_token_ids != alone  # the seed matters


def test_temperature_zero_and_top_k_one_are_greedy(model_dir):
    prompts = random_prompts(4, [6, 20], 211, seed=2)
    engine = Engine.from_config(EngineConfig(model=model_dir, device="cpu", max_model_len=256))
    greedy = [r.output_token_ids for r in engine.generate(
        [Request(i, p, SamplingParams(max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)])]
    t0 = [r.output_token_ids for r in engine.generate(
        [Request(i, p, SamplingParams(max_tokens=20, temperature=0.0, seed=i, ignore_eos=True))
         for i, p in enumerate(prompts)])]
    k1 = [r.output_token_ids for r in engine.generate(
        [Request(i, p, SamplingParams(max_tokens=20, temperature=1.5, top_k=1, seed=i, ignore_eos=True))
         for i, p in enumerate(prompts)])]
    assert greedy == t0 == k1


def test_stop_conditions(model_dir):
    engine = Engine.from_config(EngineConfig(model=model_dir, device="cpu", max_model_len=64))
    p = random_prompts(1, [10], 211, seed=7)[0]
    free = engine.generate([Request(0, p, SamplingParams(max_tokens=20, ignore_eos=True))])[0]
    stop_tok = free.output_token_ids[5]
    first = free.output_token_ids.index(stop_tok)
    r = engine.generate([Request(0, p, SamplingParams(max_tokens=20, ignore_eos=True,
                                                      stop_token_ids=(stop_tok,)))])[0]
    assert r.finish_reason == "stop" and r.output_token_ids == free.output_token_ids[:first + 1]
    r = engine.generate([Request(0, p, SamplingParams(max_tokens=3))])[0]
    assert r.finish_reason in ("length", "stop") and len(r.output_token_ids) <= 3
    bad = engine.generate([Request("e", [], SamplingParams()),
                           Request("l", p, SamplingParams(max_tokens=60)),
                           Request("a", p, SamplingParams(max_tokens=2), adapter="nope")])
    assert [b.finish_reason for b in bad] == ["error"] * 3
    assert "empty prompt" in bad[0].error
    assert "exceeds max_model_len (64)" in bad[1].error
    assert "LoRA is not enabled" in bad[2].error
