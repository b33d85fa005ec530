"""One EngineConfig (#10): the job file's engine: section, batchrun.LLM's keywords and the bench
flags all build batchrun.engine.config.EngineConfig, which checks its values once with job-file field
paths; the fingerprint of an unchanged job file is what it was before."""
import dataclasses

import pytest

from batchrun.engine.config import EngineConfig, job_engine_fields
from batchrun.errors import ConfigError
from batchrun.job.fingerprint import combine, job_fingerprint
from batchrun.job.spec import parse_job


def _job(tmp_path, **engine):
    return {"model": str(tmp_path / "model"), "adapters": None,
            "input": {"path": "/in.parquet", "id_column": "id"}, "output": {"path": "/out"},
            "sampling": {"max_tokens": 8, "temperature": 0.5}, "engine": engine}


def test_engine_section_is_the_engine_config(tmp_path):
    spec = parse_job(_job(tmp_path, device="cpu", max_model_len=128, gpu_memory_utilization=1), "/")
    assert isinstance(spec.engine, EngineConfig)
    # a job's max_num_seqs defaults to auto (EngineConfig's Python default stays 64)
    assert spec.engine == EngineConfig(model=spec.model, device="cpu", max_model_len=128,
                                       gpu_memory_utilization=1.0, seed=0, max_num_seqs="auto")
    assert isinstance(spec.engine.gpu_memory_utilization, float)
    raw = _job(tmp_path)
    raw["adapters"], raw["input"]["adapter_column"] = {"a": "/ads/a"}, "adapter"
    raw["sampling"]["seed"] = 7
    spec = parse_job(raw, "/")
    assert spec.engine.enable_lora and spec.engine.seed == 7  # from adapters: and sampling.seed


def test_every_engine_field_but_the_derived_ones_is_a_job_field(tmp_path):
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(job_engine_fields()) == names - {"model", "enable_lora", "seed", "experiments"}
    spec = parse_job(_job(tmp_path, block_size=32, num_kv_blocks=100, cuda_graph_sizes=[1, 8]), "/")
    assert spec.engine.block_size == 32 and spec.engine.cuda_graph_sizes == [1, 8]
    with pytest.raises(ConfigError, match=r"engine.model: unknown field \(allowed under engine: device, dtype"):
        parse_job(_job(tmp_path, model="x"), "/")


@pytest.mark.parametrize("engine, message", [
    ({"block_size": 0}, "engine.block_size: must be >= 1, got 0"),
    ({"num_kv_blocks": "x"}, r"engine.num_kv_blocks: expected an integer or null, got 'x' \(str\)"),
    ({"cuda_graph_sizes": [0]}, "engine.cuda_graph_sizes: expected a list of batch sizes"),
    ({"gpu_memory_utilization": 1.5}, r"engine.gpu_memory_utilization: must be in \(0, 1\], got 1.5"),
    ({"cpu_kv_cache_gb": float("inf")}, "engine.cpu_kv_cache_gb: must be a finite number"),
    ({"lora_fused_max_tokens": -1}, "engine.lora_fused_max_tokens: must be >= 0"),
])
def test_engine_messages(tmp_path, engine, message):
    with pytest.raises(ConfigError, match=message):
        parse_job(_job(tmp_path, **engine), "/")
    with pytest.raises(ConfigError, match=message):  # the same words from Python
        EngineConfig(model="m", **engine)


def test_fingerprint_of_an_unchanged_job_file_is_unchanged(tmp_path):
    # the value the code before one EngineConfig computed for this job (an empty model directory)
    (tmp_path / "model").mkdir()  # the digest reads names and contents, not the path
    raw = _job(tmp_path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
               gpu_memory_utilization=1, max_loras=2, enforce_eager=True)
    assert combine(job_fingerprint(parse_job(raw, "/"), [], [], [])) == "8e30caab29d0fcaf"
