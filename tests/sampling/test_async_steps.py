"""Async scheduling (experiments.async_scheduling, Engine.step_async in engine/engine.py): the host
plans step n+1 before it has read step n's tokens. Every row's result must equal the synchronous
loop's, whatever ends it (length, EOS / stop token, stop string, min_tokens), however it samples
(greedy, temperature / top-k / top-p with seeds, logprobs, penalties: those wait for their
tokens), while rows join as others leave, under preemption, with prefix caching and mixed steps,
and with LoRA (CPU fp32).
"""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.envs import Experiments
from batchrun.engine.request import Request
from tests.helpers.adapters import save_peft_adapters
from tests.helpers.models import random_prompts, save_hf_model

PROMPTS = ["hello world", "abc xyz", "tiny model run", "a", "the quick brown fox jumps",
           "zz top", "one two three four", "lorem ipsum dolor", "qq", "batch rows"]


def engine(model, adapters=None, async_scheduling=True, mixed_steps=False, num_kv_blocks=None,
           **cfg):
    cfg = dict(dict(device="cpu", max_model_len=128, max_num_seqs=3), **cfg)
    cfg["experiments"] = Experiments(async_scheduling=async_scheduling, mixed_steps=mixed_steps,
                                     num_kv_blocks=num_kv_blocks)
    return Engine.from_config(EngineConfig(model=model, enable_lora=bool(adapters), **cfg),
                              adapters=adapters)


def run(eng, requests, spy=None):
    """Results of `requests`, and per decode step: (rows, rows whose input token was pending)."""
    steps = []
    orig = eng.runner.decode

    def decode(batch, prev=None):
        steps.append((len(batch.seqs), sum(1 for j in batch.pending_rows if j >= 0)))
        return orig(batch, prev)
    eng.runner.decode = decode
    try:
        return eng.generate(requests), steps
    finally:
        eng.runner.decode = orig


def fields(results):
    """What must match exactly (the steps' batch sizes differ between the loops, so fp32
    logprobs may differ in the last bits: `same_logprobs`)."""
    return [(r.request_id, r.output_token_ids, r.output_text, r.finish_reason, r.stop_reason,
             r.error, None if r.top_logprobs is None else [[t for t, _ in top] for top in r.top_logprobs])
            for r in results]


def same_results(got, want):
    assert fields(got) == fields(want)
    for g, w in zip(got, want):
        assert (g.logprobs is None) == (w.logprobs is None)
        if w.logprobs is not None:
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
            for gt, wt in zip(g.top_logprobs, w.top_logprobs):
                assert [v for _, v in gt] == pytest.approx([v for _, v in wt], abs=1e-5)


@pytest.fixture(scope="module")
def tok(char_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(char_model)


def mixed_requests(base, prompts):
    """Rows ending every way there is, cut from a plain greedy run's outputs `base`."""
    reqs = []
    for i, (p, b) in enumerate(zip(prompts, base)):
        out = b.output_token_ids
        kind = i % 7
        if kind == 0:
            sp = SamplingParams(max_tokens=12 + i, ignore_eos=True)
        elif kind == 1:  # a stop token the row reaches on its 4th token
            sp = SamplingParams(max_tokens=20, stop_token_ids=(out[3],))
        elif kind == 2:  # a stop string from its output
            sp = SamplingParams(max_tokens=20, stop=(b.output_text[5:7],))
        elif kind == 3:
            sp = SamplingParams(max_tokens=15, temperature=0.8, top_k=7, top_p=0.9, seed=100 + i,
                                logprobs=3)
        elif kind == 4:  # penalties: its next step reads its tokens on the host
            sp = SamplingParams(max_tokens=10, repetition_penalty=1.4, presence_penalty=0.3)
        elif kind == 5:  # the stop token comes before min_tokens: it must not end the row there
            sp = SamplingParams(max_tokens=14, min_tokens=6, stop_token_ids=(out[1],),
                                temperature=0.5, seed=i)
        else:
            sp = SamplingParams(max_tokens=1 + i % 3, logprobs=0)
        reqs.append(Request(i, p, sp))
    return reqs


@pytest.mark.parametrize("cfg", [
    {},
    {"max_num_seqs": 5, "num_kv_blocks": 13, "block_size": 4, "max_model_len": 48},  # preemption
    {"mixed_steps": True, "max_num_batched_tokens": 12, "enable_prefix_caching": False},
], ids=["plain", "preempt", "mixed"])
def test_async_steps_give_the_synchronous_results(char_model, tok, cfg):
    prompts = [tok(p)["input_ids"] for p in PROMPTS] * 2  # repeats: prefix-cache hits
    sync_eng, async_eng = engine(char_model, async_scheduling=False, **cfg), engine(char_model, **cfg)
    base, _ = run(sync_eng, [Request(i, p, SamplingParams(max_tokens=20, ignore_eos=True))
                             for i, p in enumerate(prompts)])
    reqs = mixed_requests(base, prompts)
    want, sync_steps = run(sync_eng, reqs)
    got, async_steps = run(async_eng, reqs)
    same_results(got, want)
    assert sorted(r.request_id for r in got) == list(range(len(prompts)))  # each id exactly once
    reasons = {r.finish_reason for r in want} | {type(r.stop_reason).__name__ for r in want}
    assert {"length", "stop", "int", "str"} <= reasons, reasons  # every ending was exercised
    assert not any(p for _, p in sync_steps)
    assert sum(p for _, p in async_steps) > 0.5 * sum(n for n, _ in async_steps), async_steps
    if "num_kv_blocks" in cfg:
        assert async_eng.stats["preemptions"] > 0 and sync_eng.stats["preemptions"] > 0


def test_rows_ending_by_length_take_no_extra_step(char_model, tok):
    """A row whose pending token is its last (max_tokens) is left out of the next step, so with
    only length endings both loops decode the same rows; a row ending on a stop token runs
    exactly one step more under async scheduling (its extra token is dropped)."""
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    sync_eng, async_eng = engine(char_model, async_scheduling=False), engine(char_model)
    reqs = [Request(i, p, SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    want, sync_steps = run(sync_eng, reqs)
    got, async_steps = run(async_eng, reqs)
    same_results(got, want)
    assert sum(n for n, _ in async_steps) == sum(n for n, _ in sync_steps) == sum(2 + 2 * i for i in range(len(prompts)))

    stop = want[0].output_token_ids[2]  # row 0 ends on its 3rd token, every other by length
    reqs[0] = Request(0, prompts[0], SamplingParams(max_tokens=20, stop_token_ids=(stop,)))
    want, sync_steps = run(sync_eng, reqs)
    got, async_steps = run(async_eng, reqs)
    same_results(got, want)
    assert want[0].finish_reason == "stop"
    assert sum(n for n, _ in async_steps) == sum(n for n, _ in sync_steps) + 1


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("async_lora")
    save_hf_model("llama3_gqa", d / "model", seed=5)
    return str(d / "model"), save_peft_adapters(d, ["a", "b", "c"], rank=4,
                                                targets=("q_proj", "v_proj", "down_proj"))


def test_async_steps_with_lora_and_preemption(lora_model):
    """Adapters over 2 slots (rows wait for a slot and slots change hands while a finished row's
    extra step is in flight), a KV cache small enough to preempt: the synchronous results."""
    model, adapters = lora_model
    prompts = random_prompts(14, [5, 17, 3, 30, 9], 200, seed=8)
    names = [None, "a", "b", "c", "a", None, "c"] * 2
    reqs = [Request(i, p, SamplingParams(max_tokens=4 + 3 * (i % 5), ignore_eos=i % 2 == 0,
                                         stop_token_ids=() if i % 2 == 0 else (i * 7 % 200,)),
                    adapter=n) for i, (p, n) in enumerate(zip(prompts, names))]
    cfg = dict(max_num_seqs=4, max_loras=2, num_kv_blocks=13, block_size=4, max_model_len=48)
    want, _ = run(engine(model, adapters, async_scheduling=False, **cfg), reqs)
    eng = engine(model, adapters, **cfg)
    got, steps = run(eng, reqs)
    same_results(got, want)
    assert eng.stats["preemptions"] > 0
    assert sum(p for _, p in steps) > 0


def test_a_preempted_row_whose_pending_token_ends_it_finishes_from_the_queue():
    """The newest row's pending token is its last (max_tokens), an older row needs a block and
    none is free: the scheduler preempts the newest row (it waits in the queue), then reading
    its token back ends it there; nothing counts as recomputed and no row is left behind."""
    from batchrun.engine.block_manager import BlockManager
    from batchrun.engine.scheduler import Scheduler
    from batchrun.engine.sequence import Sequence, SeqStatus
    sched = Scheduler(EngineConfig(model="m", max_num_seqs=4, max_model_len=16),
                      BlockManager(3, 4))  # the scratch block + 2
    old = Sequence(0, "old", [5, 6, 7, 8], SamplingParams(max_tokens=8), None, None)
    new = Sequence(1, "new", [5, 6, 7], SamplingParams(max_tokens=1), None, None)
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [old, new]
    # scheduling the step computed both prompts and counted each row's sampled token as pending
    assert [(s.num_computed, s.num_pending) for s in batch.seqs] == [(4, 1), (3, 1)]
    batch = sched.schedule()  # old's pending token needs a second block: new is the victim
    assert not batch.is_prefill and batch.seqs == [old]
    assert new.status is SeqStatus.WAITING and list(sched.waiting) == [new]
    assert sched.num_recomputed_tokens == 3
    # the engine reads the first step's tokens back: new's ends it by length
    assert sched.update([old, new], [3, 9], [None, None], [None, None]) == [new]
    assert new.token_ids[-1] == 9 and new.num_pending == 0 and new.finish_reason == "length"
    assert new.status is SeqStatus.FINISHED and not sched.waiting and sched.running == [old]
    assert sched.num_recomputed_tokens == 0 and sched.blocks.num_free == 0
