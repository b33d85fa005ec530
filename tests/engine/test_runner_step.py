"""The model runner's explicit step and its graph ownership (CPU): every forward gets one frozen
Step whose `lora` is None exactly when no row has an adapter; graphs are read-only from
outside, and eager() runs decode steps without them for its block only."""
import dataclasses

import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.cudagraph_dispatcher import CudaGraphs, GraphKey
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence
from batchrun.engine.layers.step import LoRAStep, Step
from tests.helpers.adapters import parity_adapter
from tests.helpers.models import random_prompts, save_hf_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    save_hf_model("llama3_gqa", root / "base")
    parity_adapter("llama3_gqa", root / "a", 1, dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    cfg = EngineConfig(model=str(root / "base"), device="cpu", max_model_len=64, max_num_seqs=4,
                       enable_lora=True, max_loras=1, max_lora_rank=4)
    return Engine.from_config(cfg, adapters={"a": str(root / "a")})


def _steps_of(engine, adapters, monkeypatch):
    """The Steps the model got for one prefill and one decode step of rows running `adapters`."""
    seen = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda ids, pos, step: seen.append(step) or forward(ids, pos, step))
    sched = Scheduler(engine.config, engine.blocks, engine.lora)
    for i, (p, a) in enumerate(zip(random_prompts(len(adapters), [5, 3, 8], 100, seed=2), adapters)):
        sched.add(Sequence(i, i, p, SamplingParams(max_tokens=4, ignore_eos=True), a, None))
    try:
        engine.step(sched)
        engine.step(sched)
    finally:
        for seq in list(sched.running):
            sched.finish(seq, "length")
    assert [s.attn.is_prefill for s in seen] == [True, False]
    return seen


def test_a_step_without_adapter_rows_has_no_lora_part(engine, monkeypatch):
    for step in _steps_of(engine, [None, None, None], monkeypatch):
        assert isinstance(step, Step) and step.lora is None
    for step in _steps_of(engine, [None, "a", None], monkeypatch):
        assert isinstance(step.lora, LoRAStep) and not step.lora.fuse  # CPU: shrink + expand
        with pytest.raises(dataclasses.FrozenInstanceError):
            step.lora = None


def test_graphs_are_read_only_and_eager_is_scoped(engine, monkeypatch):
    runner = engine.runner
    assert runner.graphs is None  # CPU: never captured
    with pytest.raises(AttributeError):
        runner.graphs = None
    replays, eager_steps = [], []
    forward = runner.decode_forward

    class FakeDecodeGraphs:  # stands in for captured decode graphs of every size up to 4
        sizes = [1, 2, 3, 4]

        def replay(self, key):  # what a no-LoRA graph computes from the static inputs
            replays.append(key)
            return forward(key.tokens, None)
    monkeypatch.setattr(runner, "_graphs", CudaGraphs(True, decode=FakeDecodeGraphs()))
    monkeypatch.setattr(runner, "decode_forward", lambda rows, lora: eager_steps.append(rows) or forward(rows, lora))
    sched = Scheduler(engine.config, engine.blocks, engine.lora)
    for i, p in enumerate(random_prompts(2, [4, 6], 100, seed=4)):
        sched.add(Sequence(i, i, p, SamplingParams(max_tokens=8, ignore_eos=True), None, None))
    try:
        engine.step(sched)  # prefill: always eager
        engine.step(sched)
        assert replays == [GraphKey(2, True, 0)] and eager_steps == []
        with runner.eager():
            with runner.eager():
                engine.step(sched)
            engine.step(sched)  # the inner block's exit leaves the outer one eager
        assert len(replays) == 1 and eager_steps == [2, 2]
        engine.step(sched)
        assert len(replays) == 2
    finally:
        for seq in list(sched.running):
            sched.finish(seq, "length")


def test_decode_block_tables_follow_every_change_of_a_rows_blocks(engine):
    """The host block table is rewritten only for rows whose blocks changed (model_runner's
    _write_block_tables): growth, a new list of the same length (preemption + re-admission),
    another sequence in the row, rows turning into padding and back. After every step the
    table the step reads equals one written from scratch."""
    from batchrun.engine.block_manager import SCRATCH_BLOCK
    runner = engine.runner
    mb = runner.max_blocks_per_seq

    def seq(i, blocks):
        s = Sequence(i, i, [7] * (len(blocks) * runner.block_size - 1), SamplingParams(), None, None)
        s.block_ids = list(blocks)
        return s

    def check(seqs, rows):
        runner._write_decode_inputs(seqs, [len(s.token_ids) - 1 for s in seqs], [-1] * len(seqs),
                                    rows, num_slots=0, prev_tokens=None)
        got = runner.block_tables[:rows].tolist()
        want = [s.block_ids + [0] * (mb - len(s.block_ids)) for s in seqs]
        want += [[SCRATCH_BLOCK] * mb] * (rows - len(seqs))
        assert got == want
        assert runner.context_lens[:len(seqs)].tolist() == [len(s.token_ids) for s in seqs]

    a, b = seq(0, [3, 4]), seq(1, [5])
    check([a, b], 4)
    a.block_ids.extend([6]); a.token_ids += [1] * runner.block_size   # grows in place
    check([a, b], 4)
    a.block_ids = [9, 8, 2]                                             # same length, new list
    check([a, b], 4)
    check([b, a], 4)                                                    # rows swap sequences
    check([a], 2)                                                       # row 1 becomes padding
    c = seq(2, [11, 12, 13])
    check([a, c], 2)                                                    # and a row again
    check([c, a, b, seq(3, [1])], 4)


def test_step_times_are_counted_by_kind(engine):
    """engine.stats splits the wall time of steps by kind; the host part of decode is within it."""
    from batchrun.engine.request import Request
    before = dict(engine.stats)
    reqs = [Request(i, p, SamplingParams(max_tokens=5, ignore_eos=True))
            for i, p in enumerate(random_prompts(3, [5, 3, 8], 100, seed=4))]
    engine.generate(reqs)
    d = {k: engine.stats[k] - before[k] for k in before}
    assert d["decode_steps"] == 4 and d["prefill_steps"] >= 1
    assert d["prefill_s"] > 0 and d["decode_s"] > 0 and d["mixed_s"] == 0
    assert 0 < d["decode_host_s"] <= d["decode_s"]


def _state(seq):
    return {k: (list(v) if isinstance(v, list) else v) for k, v in vars(seq).items()}


def test_only_the_scheduler_changes_sequence_state(engine):
    """schedule() advances num_computed and counts the sampled token as pending; executing the
    step (model runner, sampling) leaves every Sequence as it was; update() appends the token,
    takes the pending count back and finishes rows. Prefill, then decode."""
    sched = engine.scheduler()
    prompts = random_prompts(2, [5, 7], 100, seed=6)
    seqs = [Sequence(i, i, p, SamplingParams(max_tokens=2, ignore_eos=True), a, None)
            for i, (p, a) in enumerate(zip(prompts, [None, "a"]))]
    for s in seqs:
        sched.add(s)
    try:
        for kind in ("prefill", "decode"):
            before = [s.num_tokens for s in seqs]
            batch = sched.schedule()
            assert batch.is_prefill == (kind == "prefill")
            assert [s.num_computed for s in batch.seqs] == before
            assert all(s.num_pending == 1 for s in batch.seqs)
            states = [_state(s) for s in seqs]
            launched = engine.executor.execute(batch, None)
            assert [_state(s) for s in seqs] == states  # the runner and sampler wrote nothing
            out = launched.sampled.result()
            finished = sched.update(launched.seqs, out.tokens, out.logprobs, out.top_logprobs)
            assert all(s.num_pending == 0 for s in seqs)
            assert [s.num_tokens for s in seqs] == [n + 1 for n in before]
        assert finished == seqs and all(s.finish_reason == "length" for s in seqs)
    finally:
        for seq in list(sched.running):
            sched.finish(seq, "length")
