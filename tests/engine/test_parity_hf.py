"""Greedy output token ids identical to transformers generate() in fp32 on CPU."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from tests.helpers.models import hf_greedy, random_prompts, save_hf_model, VARIANTS

LENGTHS = [1, 7, 33, 200, 64, 3]
NEW = 40


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf(tmp_path, variant):
    hf = save_hf_model(variant, tmp_path / "m")
    prompts = random_prompts(6, LENGTHS, hf.config.vocab_size, seed=1)
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device="cpu",
                                             max_model_len=512, max_num_batched_tokens=256))
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    results = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        assert r.finish_reason == "length"
        assert r.output_token_ids == hf_greedy(hf, p, NEW), f"prompt len {len(p)}"
