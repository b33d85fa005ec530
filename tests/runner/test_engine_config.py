"""One EngineConfig (#10): the job file's engine: section, batchrun.LLM's keywords and the bench
flags all build batchrun.engine.config.EngineConfig, which checks its values once with job-file field
paths; the fingerprint of an unchanged job file is what it was before."""
import dataclasses

import pytest

from batchrun.engine.config import REMOVED_ENGINE_KEYS, EngineConfig, job_engine_fields
from batchrun.engine.envs import Experiments, env_name
from batchrun.errors import ConfigError
from batchrun.job.store.fingerprint import combine, job_fingerprint
from batchrun.job.jobfile.spec import parse_job


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
    spec = parse_job(_job(tmp_path, block_size=32, cuda_graph_sizes=[1, 8]), "/")
    assert spec.engine.block_size == 32 and spec.engine.cuda_graph_sizes == [1, 8]
    with pytest.raises(ConfigError, match=r"engine.model: unknown field \(allowed under engine: device, dtype"):
        parse_job(_job(tmp_path, model="x"), "/")


@pytest.mark.parametrize("engine, message", [
    ({"block_size": 0}, "engine.block_size: must be >= 1, got 0"),
    ({"max_cpu_loras": "x"}, r"engine.max_cpu_loras: expected an integer or null, got 'x' \(str\)"),
    ({"cuda_graph_sizes": [0]}, "engine.cuda_graph_sizes: expected a list of batch sizes"),
    ({"gpu_memory_utilization": 1.5}, r"engine.gpu_memory_utilization: must be in \(0, 1\], got 1.5"),
    ({"cpu_kv_cache_gb": float("inf")}, "engine.cpu_kv_cache_gb: must be a finite number"),
])
def test_engine_messages(tmp_path, engine, message):
    with pytest.raises(ConfigError, match=message):
        parse_job(_job(tmp_path, **engine), "/")
    with pytest.raises(ConfigError, match=message):  # the same words from Python
        EngineConfig(model="m", **engine)


# the user keys (vLLM's equivalents); FP8's quantization and kv_cache_dtype come on top
# quantization and kv_cache_dtype: vLLM's names for what FP8 changes (issue #47)
USER_KEYS = ("device", "dtype", "quantization", "kv_cache_dtype", "max_num_seqs", "max_model_len", "max_loras", "max_lora_rank",
             "enforce_eager", "max_num_batched_tokens", "gpu_memory_utilization", "block_size",
             "cpu_kv_cache_gb", "max_cpu_loras", "enable_prefix_caching", "cuda_graph_sizes")


def test_engine_section_holds_only_user_keys():
    assert job_engine_fields() == USER_KEYS and len(USER_KEYS) <= 16
    experiment_fields = {f.name for f in dataclasses.fields(Experiments)}
    assert set(REMOVED_ENGINE_KEYS.values()) <= experiment_fields
    assert not set(REMOVED_ENGINE_KEYS) & set(job_engine_fields())
    assert "pdl" not in job_engine_fields()


@pytest.mark.parametrize("key, value, setting", [
    ("async_scheduling", False, "BATCHRUN_ASYNC_SCHEDULING=0"),
    ("enable_mixed_steps", True, "BATCHRUN_MIXED_STEPS=1"),
    ("triton_decode_gemm", False, "BATCHRUN_TRITON_DECODE_GEMM=0"),
    ("pdl", True, "BATCHRUN_PDL=1"),
    ("prefill_graph_max_tokens", 0, "BATCHRUN_PREFILL_GRAPH_MAX_TOKENS=0"),
    ("lora_fused_max_tokens", 256, "BATCHRUN_LORA_FUSED_MAX_TOKENS=256"),
    ("num_kv_blocks", 100, "BATCHRUN_NUM_KV_BLOCKS=100"),
])
def test_a_removed_engine_key_names_its_variable(tmp_path, monkeypatch, key, value, setting):
    message = (f"engine.{key} was removed: it is an experiment switch now, set {setting} in the "
               "environment")
    with pytest.raises(ConfigError, match=message):
        parse_job(_job(tmp_path, device="cpu", **{key: value}), "/")
    # the variable named is one Experiments (or kernels/pdl.py) reads, and it sets what the key did
    var, raw = setting.split("=")
    if key == "pdl":
        from batchrun.kernels.pdl import flag_from_env
        assert flag_from_env(var, not value, {var: raw}) is value
        return
    field = REMOVED_ENGINE_KEYS[key]
    assert var == env_name(field)
    assert getattr(Experiments.from_env({var: raw}), field) == value


def test_llm_keywords_get_the_removed_key_message(tmp_path):
    from batchrun.api import LLM
    with pytest.raises(ConfigError, match="engine.async_scheduling was removed: .* set "
                                          "BATCHRUN_ASYNC_SCHEDULING=0 in the environment"):
        LLM(tmp_path / "model", device="cpu", async_scheduling=False)


def test_fingerprint_of_an_unchanged_job_file_is_unchanged(tmp_path):
    # the value the code before one EngineConfig computed for this job (an empty model directory)
    (tmp_path / "model").mkdir()  # the digest reads names and contents, not the path
    raw = _job(tmp_path, device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
               gpu_memory_utilization=1, max_loras=2, enforce_eager=True)
    assert combine(job_fingerprint(parse_job(raw, "/"), [], [], [])) == "8e30caab29d0fcaf"
