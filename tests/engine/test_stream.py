"""Engine.generate_stream: requests that arrive over time (a trickling source, more adapters than
LoRA slots, base and adapter rows interleaved) give the same tokens as generate(list), every step
holds at most max_loras adapters, and nothing deadlocks."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from tests.helpers.adapters import save_peft_adapters
from tests.helpers.models import random_prompts, save_hf_model

NEW = 6
NAMES = ["a", "b", "c"]


class Trickle:
    """A RequestSource that has one request ready every other take (``[]`` in between)."""

    def __init__(self, requests, fail_at=None):
        self.requests, self.pos, self.calls, self.fail_at = list(requests), 0, 0, fail_at
        self.not_ready = 0

    def take(self, n, wait):
        self.calls += 1
        if self.fail_at is not None and self.pos >= self.fail_at:
            raise LookupError("the reader broke")
        if self.pos >= len(self.requests):
            return None
        if not wait and self.calls % 2:
            self.not_ready += 1
            return []
        self.pos += 1
        return [self.requests[self.pos - 1]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    save_hf_model("llama3_gqa", root / "base", seed=3)
    adapters = save_peft_adapters(root, NAMES, seed=10)
    return Engine.from_config(EngineConfig(model=str(root / "base"), device="cpu", max_model_len=128,
                                           max_num_seqs=4, max_num_batched_tokens=64, enable_lora=True,
                                           max_loras=2, max_lora_rank=4), adapters=adapters)


def _requests():
    names = [None, "a", "b", "c", None, "c", "a", "b", "b", None, "c", "a", "a", "c"]
    prompts = random_prompts(len(names), [3, 11, 25, 7], 128, seed=8)
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    return [Request(("r", i), p, sp, adapter=n) for i, (p, n) in enumerate(zip(prompts, names))]


def test_trickled_stream_equals_list_and_respects_lora_slots(engine):
    want = {r.request_id: r.output_token_ids for r in engine.generate(_requests())}
    steps = []
    orig = engine.runner.decode

    def decode(batch, prev=None):
        steps.append({s.adapter for s in batch.seqs} - {None})
        return orig(batch, prev)
    engine.runner.decode = decode
    try:
        got = {}
        src = Trickle(_requests())
        engine.generate_stream(src, lambda r: got.__setitem__(r.request_id, r.output_token_ids))
    finally:
        engine.runner.decode = orig
    assert got == want and len(got) == 14
    assert src.not_ready > 0  # the engine kept stepping while the source had nothing ready
    assert max(len(s) for s in steps) == 2  # two adapters shared steps, never three (2 slots)
    assert all(engine.lora.pinned(n) == 0 for n in NAMES)  # every slot pin was released


def test_plain_iterable_and_generator_sources(engine):
    want = [r.output_token_ids for r in engine.generate(_requests())]
    got = []
    engine.generate_stream((r for r in _requests()), lambda r: got.append((r.request_id, r.output_token_ids)))
    assert dict(got) == {("r", i): w for i, w in enumerate(want)}


def test_source_error_reaches_the_caller_and_frees_the_engine(engine):
    free = engine.blocks.num_free
    with pytest.raises(LookupError, match="the reader broke"):
        engine.generate_stream(Trickle(_requests(), fail_at=5), lambda r: None)
    assert engine.blocks.num_free == free  # the running sequences' KV blocks came back
    assert all(engine.lora.pinned(n) == 0 for n in NAMES)  # and their LoRA slot pins
    # the next call starts clean (the failed stream's sequences do not linger in a scheduler)
    res = engine.generate(_requests()[:3])
    assert all(r.finish_reason == "length" for r in res)
