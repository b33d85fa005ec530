"""The model runner's explicit step and its graph ownership (CPU): every forward gets one frozen
Step whose `lora` is None exactly when no row has an adapter; graphs are read-only from
outside, and eager() runs decode steps without them for its block only."""
import dataclasses

import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.graphs import GraphKey, GraphRunner
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

    class FakeGraphs:  # stands in for captured graphs: the runner's dispatch/replay calls
        def dispatch(self, b, lora_slots):
            return GraphKey(b, lora_slots)

        def replay(self, key):  # what a no-LoRA graph computes from the static inputs
            replays.append(key)
            return forward(key.padded_batch_size, None)
    monkeypatch.setattr(runner, "_graphs", FakeGraphs())
    monkeypatch.setattr(runner, "decode_forward", lambda rows, lora: eager_steps.append(rows) or forward(rows, lora))
    sched = Scheduler(engine.config, engine.blocks, engine.lora)
    for i, p in enumerate(random_prompts(2, [4, 6], 100, seed=4)):
        sched.add(Sequence(i, i, p, SamplingParams(max_tokens=8, ignore_eos=True), None, None))
    try:
        engine.step(sched)  # prefill: always eager
        engine.step(sched)
        assert replays == [GraphKey(2, 0)] and eager_steps == []
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


def test_graph_capture_needs_lora_steps_exactly_for_the_lora_sets():
    cfg = EngineConfig(model="unused", device="cpu", max_num_seqs=4)
    with pytest.raises(ValueError, match="needs LoRA steps"):
        GraphRunner(cfg, with_lora=True).capture(lambda rows, lora: None, None)
    meta = torch.zeros(1)
    with pytest.raises(ValueError, match="needs no LoRA step"):
        GraphRunner(cfg, with_lora=False).capture(lambda rows, lora: None,
                                                   {1: LoRAStep(meta, meta, fuse=True, num_slots=1)})
    with pytest.raises(ValueError, match="keyed by their slot bound"):
        GraphRunner(cfg, with_lora=True).capture(lambda rows, lora: None,
                                                  {2: LoRAStep(meta, meta, fuse=True, num_slots=1)})


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
        runner._write_decode_inputs(seqs, rows, num_slots=0, prev_tokens=None)
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
