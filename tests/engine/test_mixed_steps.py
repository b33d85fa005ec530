"""Mixed steps (CPU fp32): decode rows and prompt chunks in one step, within the token budget;
the same greedy tokens as with mixed steps off (and as HF), under preemption, chunked prompts and
LoRA; the scheduler never drops a row it already put in the step; the config switch."""

import pytest

import batchrun.engine.scheduler as scheduler_mod
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.envs import Experiments
from batchrun.engine.request import Request
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence, SeqStatus
from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import parse_job
from tests.helpers.adapters import parity_adapter
from tests.helpers.models import hf_greedy, random_prompts, save_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed") / "llama3_gqa"
    return str(d), save_hf_model("llama3_gqa", d, seed=3)


@pytest.fixture
def batches(monkeypatch):
    """Every scheduled batch: (is_prefill, num_decode, counts, seqs' remaining-before counts)."""
    seen = []
    orig = Scheduler.schedule

    def schedule(self):
        b = orig(self)
        seen.append((b.is_prefill, b.num_decode, list(b.num_tokens),
                     [s.num_tokens - (i in b.sampled) - start
                      for i, (s, start) in enumerate(zip(b.seqs, b.starts))],
                     [s.lora_slot for s in b.seqs]))
        return b
    monkeypatch.setattr(scheduler_mod.Scheduler, "schedule", schedule)
    return seen


def generate(model_dir, prompts, max_tokens, adapters=None, names=None, mixed_steps=True,
             num_kv_blocks=None, **cfg):
    # mixed steps are opt-in (Experiments' default is off)
    cfg = dict(dict(device="cpu", max_model_len=256), **cfg)
    cfg["experiments"] = Experiments(mixed_steps=mixed_steps, num_kv_blocks=num_kv_blocks)
    engine = Engine.from_config(EngineConfig(model=model_dir, enable_lora=bool(adapters), **cfg),
                                adapters=adapters)
    names = names or [None] * len(prompts)
    res = engine.generate([Request(i, p, SamplingParams(max_tokens=m, ignore_eos=True), adapter=n)
                           for i, (p, m, n) in enumerate(zip(prompts, max_tokens, names))])
    assert all(r.finish_reason == "length" for r in res), [r.error for r in res]
    return [r.output_token_ids for r in res], engine.stats


def test_rows_arriving_while_others_decode_share_steps_within_budget(model, batches):
    model_dir, hf = model
    prompts = random_prompts(10, [7, 30, 3, 18, 50], 211, seed=11)
    max_tokens = [4 + 3 * (i % 4) for i in range(10)]  # staggered ends: rows arrive mid-decode
    on, stats = generate(model_dir, prompts, max_tokens, max_num_seqs=4, max_num_batched_tokens=40)
    assert stats["mixed_steps"] > 0
    assert stats["steps"] == stats["prefill_steps"] + stats["decode_steps"] + stats["mixed_steps"]
    mixed = [b for b in batches if b[0] and b[1] > 0]
    assert len(mixed) == stats["mixed_steps"]
    for is_prefill, nd, counts, remaining, _ in batches:
        assert sum(counts) <= 40  # max_num_seqs (4) <= budget: every step within it
        if is_prefill:  # decode rows first, one token each (the last sampled one)
            assert counts[:nd] == [1] * nd and remaining[:nd] == [1] * nd
    batches.clear()
    off, stats_off = generate(model_dir, prompts, max_tokens, max_num_seqs=4,
                              max_num_batched_tokens=40, mixed_steps=False)
    assert stats_off["mixed_steps"] == 0 and all(nd == 0 for _, nd, *_ in batches)
    assert stats_off["steps"] > stats["steps"]  # the decode steps a prefill step stalled
    assert on == off
    for i in (0, 3, 6):
        assert on[i] == hf_greedy(hf, prompts[i], max_tokens[i]), f"row {i}"


def test_chunked_long_prompt_runs_beside_decode_rows(model, batches):
    model_dir, _ = model
    prompts = random_prompts(4, [6, 9, 4], 211, seed=4) + random_prompts(1, [130], 211, seed=8)
    max_tokens = [3, 24, 24, 24, 6]
    on, stats = generate(model_dir, prompts, max_tokens, max_num_seqs=4, max_num_batched_tokens=48)
    # the 130-token prompt comes in once row 0 finishes; its chunks ride with 3 decode rows
    chunked = [b for b in batches if b[1] > 0 and any(r > c for r, c in zip(b[3][b[1]:], b[2][b[1]:]))]
    assert chunked and all(sum(b[2]) <= 48 for b in batches)
    assert stats["mixed_steps"] >= 3
    off, _ = generate(model_dir, prompts, max_tokens, max_num_seqs=4, max_num_batched_tokens=48,
                      mixed_steps=False)
    assert on == off


def test_preemption_under_a_tiny_kv_cache_keeps_outputs(model):
    model_dir, _ = model
    prompts = random_prompts(17, [1, 5, 12, 40, 77, 130, 2, 9, 64], 211, seed=5)
    new = [16] * 17
    ref, _ = generate(model_dir, prompts, new, max_num_seqs=17, max_num_batched_tokens=256,
                      mixed_steps=False)
    # 16 usable blocks of 16 tokens for 17 rows: decode rows' room preempts inside mixed steps
    tight, stats = generate(model_dir, prompts, new, max_num_seqs=17, max_num_batched_tokens=48,
                            num_kv_blocks=17)
    assert stats["preemptions"] > 0 and stats["mixed_steps"] > 0
    assert tight == ref


def test_lora_and_base_rows_in_one_mixed_step(tmp_path, model, batches):
    model_dir, _ = model
    parity_adapter("llama3_gqa", tmp_path / "a", 7, dict(r=4, lora_alpha=8, target_modules="all-linear"))
    parity_adapter("llama3_gqa", tmp_path / "b", 8, dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    adapters = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    names = [None, "a", "b", None, "a", None, "b", "a"]
    prompts = random_prompts(8, [5, 17, 9, 26], 211, seed=6)
    max_tokens = [3, 8, 5, 9, 4, 7, 6, 8]
    kw = dict(max_num_seqs=3, max_num_batched_tokens=32, max_loras=2, max_lora_rank=4)
    on, stats = generate(model_dir, prompts, max_tokens, adapters, names, **kw)
    assert stats["mixed_steps"] > 0
    # some mixed step holds adapter and base tokens together (one Step, lora not None)
    assert any(b[1] > 0 and -1 in b[4] and max(b[4]) >= 0 for b in batches)
    off, _ = generate(model_dir, prompts, max_tokens, adapters, names, mixed_steps=False, **kw)
    assert on == off


def _seq(i, n, max_tokens=8):
    return Sequence(i, i, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), None, None)


def _run_step(sched, batch):
    """What the engine does with a scheduled batch: each row it samples gets token 5 back."""
    rows = [batch.seqs[i] for i in batch.sampled]
    sched.update(rows, [5] * len(rows), [None] * len(rows), [None] * len(rows))


def test_decode_rows_room_first_preempts_no_row_already_in_the_step():
    blocks = BlockManager(num_blocks=7, block_size=4)  # 6 usable blocks = 24 tokens
    sched = Scheduler(EngineConfig(model="m", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32,
                                   experiments=Experiments(mixed_steps=True)), blocks)
    for i, n in enumerate((8, 7, 7)):  # 2 + 2 + 2 blocks: the cache is full
        sched.add(_seq(i, n))
    first = sched.schedule()
    assert first.is_prefill and first.num_decode == 0 and len(first.seqs) == 3
    _run_step(sched, first)
    sched.add(_seq(3, 3))  # waits: no free block
    # row 0 (8 tokens + 1 sampled) needs a third block: the newest row (2) is preempted
    batch = sched.schedule()
    assert sched.num_preemptions == 1
    assert [s.index for s in batch.seqs] == [0, 1] and batch.num_tokens == [1, 1]
    assert all(s.status is SeqStatus.RUNNING and s.block_ids for s in batch.seqs)
    assert not batch.is_prefill  # nothing admitted in a step that preempted: a decode step
    assert [s.index for s in sched.waiting] == [2, 3]
    _run_step(sched, batch)
    # next step: row 2 comes back beside the decode rows if its blocks fit
    sched.finish(sched.running[1], "length")
    batch = sched.schedule()
    assert batch.is_mixed and batch.num_decode == 1 and [s.index for s in batch.seqs] == [0, 2, 3]
    assert batch.num_tokens == [1, 8, 3]  # row 2: prompt + its sampled token, prefilled again


def test_more_decode_rows_than_the_budget_fall_back_to_a_prefill_step():
    blocks = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(EngineConfig(model="m", max_model_len=64, max_num_seqs=8, max_num_batched_tokens=4,
                                   experiments=Experiments(mixed_steps=True)), blocks)
    for i in range(4):
        sched.add(_seq(i, 1))
    _run_step(sched, sched.schedule())
    sched.add(_seq(4, 3))  # 4 decode rows leave no token of the 4-token budget
    batch = sched.schedule()
    assert batch.is_prefill and batch.num_decode == 0 and [s.index for s in batch.seqs] == [4]


def test_mixed_steps_are_an_experiment_switch_not_a_job_key():
    assert Experiments().mixed_steps is False  # opt-in: measured no faster
    assert Experiments.from_env({"BATCHRUN_MIXED_STEPS": "1"}).mixed_steps is True
    with pytest.raises(ConfigError, match="BATCHRUN_MIXED_STEPS"):
        Experiments.from_env({"BATCHRUN_MIXED_STEPS": "yes please"})
    raw = {"model": "m", "input": {"path": "in.parquet"}, "output": {"path": "out"},
           "engine": {"enable_mixed_steps": True}}
    with pytest.raises(ConfigError, match="BATCHRUN_MIXED_STEPS"):
        parse_job(raw, base_dir="/jobs")


def test_bench_throughput_flag_is_refused_with_its_variable():
    from click.testing import CliRunner

    from batchrun.cli import main
    res = CliRunner().invoke(main, ["bench", "throughput", "--preset", "tiny", "--enable-mixed-steps"])
    assert res.exit_code == 2 and "BATCHRUN_MIXED_STEPS" in res.output, res.output
