"""engine.max_num_seqs: auto (the default of job files): the engine sizes it from the KV blocks
that fit, capped per device; an integer keeps working; it stays out of the fingerprint."""
import dataclasses
from pathlib import Path

import pytest
import torch

from batchrun.engine.config import AUTO_MAX_NUM_SEQS, EngineConfig, SamplingParams
from batchrun.engine.envs import Experiments
from batchrun.engine.engine import Engine
from batchrun.engine.cudagraph_dispatcher import capture_sizes
from batchrun.engine.request import Request
from batchrun.engine.kv_sizing import resolve_max_num_seqs
from batchrun.errors import ConfigError
from batchrun.job.store.fingerprint import job_fingerprint
from batchrun.job.jobfile.spec import parse_job
from batchrun.engine.models.config import ModelConfig

DEMO = Path(__file__).resolve().parents[2] / "demo" / "model"


def _job(**engine):
    return {"model": str(DEMO), "input": {"path": "x.parquet"}, "output": {"path": "o"}, "engine": engine}


def test_job_files_default_to_auto_and_keep_integers():
    assert parse_job(_job(), base_dir="/jobs").engine.max_num_seqs == "auto"
    assert parse_job(_job(max_num_seqs="auto"), base_dir="/jobs").engine.max_num_seqs == "auto"
    assert parse_job(_job(max_num_seqs=12), base_dir="/jobs").engine.max_num_seqs == 12
    with pytest.raises(ConfigError, match=r"engine.max_num_seqs: expected an integer, got 'lots' \(str\); or auto"):
        parse_job(_job(max_num_seqs="lots"), base_dir="/jobs")
    with pytest.raises(ConfigError, match="engine.max_num_seqs: must be >= 1"):
        parse_job(_job(max_num_seqs=0), base_dir="/jobs")


def test_auto_is_the_kv_blocks_that_fit_capped_on_cpu():
    mcfg = ModelConfig.from_dir(str(DEMO))
    cpu = torch.device("cpu")
    base = EngineConfig(model=str(DEMO), device="cpu", max_model_len=128, max_num_seqs="auto")
    assert resolve_max_num_seqs(mcfg, base, cpu, torch.float32).max_num_seqs == AUTO_MAX_NUM_SEQS["cpu"]
    for blocks, want in ((9, 1), (20, 2), (8 * 5 + 1, 5), (10_000, AUTO_MAX_NUM_SEQS["cpu"])):
        cfg = dataclasses.replace(base, experiments=Experiments(num_kv_blocks=blocks))  # 128 / 16 = 8 blocks a sequence, +1 scratch
        assert resolve_max_num_seqs(mcfg, cfg, cpu, torch.float32).max_num_seqs == want, blocks
    explicit = dataclasses.replace(base, max_num_seqs=40)
    assert resolve_max_num_seqs(mcfg, explicit, cpu, torch.float32) is explicit


def test_the_engine_runs_with_the_resolved_value():
    engine = Engine.from_config(EngineConfig(model=str(DEMO), device="cpu", max_model_len=128,
                                             max_num_seqs="auto",
                                             experiments=Experiments(num_kv_blocks=8 * 3 + 1)))
    assert engine.config.max_num_seqs == 3
    assert max(capture_sizes(engine.config.max_num_seqs)) == 3  # CUDA graph sizes follow it
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    res = engine.generate([Request(i, [1, 5 + i, 6], sp) for i in range(7)])  # more rows than seqs
    assert [len(r.output_token_ids) for r in res] == [8] * 7


def test_a_job_without_max_num_seqs_keeps_its_fingerprint():
    """max_num_seqs is performance-only (fingerprint.py): decode is per sequence and sampling noise
    is counted per (seed, position, token), so which rows share a step does not choose tokens;
    a job file from before the auto default (64) resumes its output directory."""
    names, digests = ["x.parquet"], ["d0"]
    auto = job_fingerprint(parse_job(_job(max_model_len=128), base_dir="/jobs"), ["/jobs/x.parquet"], names, [], digests)
    old = job_fingerprint(parse_job(_job(max_model_len=128, max_num_seqs=64), base_dir="/jobs"),
                          ["/jobs/x.parquet"], names, [], digests)
    assert auto == old


@pytest.mark.gpu
def test_auto_on_a_gpu_is_capped_and_graphs_follow():
    engine = Engine.from_config(EngineConfig(model=str(DEMO), device="cuda", max_model_len=128,
                                             max_num_seqs="auto"))
    n = engine.config.max_num_seqs
    assert 1 <= n <= AUTO_MAX_NUM_SEQS["cuda"]
    assert n == AUTO_MAX_NUM_SEQS["cuda"]  # the demo model's KV is tiny: the cap decides
    assert max(engine.runner.graphs.sizes) == n
