"""job.yaml parsing: defaults, relative paths, and errors that name the field and expected type."""
from pathlib import Path

import pytest

from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import load_job, parse_job

MIN = {"model": "m", "input": {"path": "in.parquet"}, "output": {"path": "out"}}


def job(**over):
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in MIN.items()}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(raw.get(k), dict):
            raw[k].update(v)
        else:
            raw[k] = v
    return raw


def err(raw, base="/jobs") -> str:
    with pytest.raises(ConfigError) as e:
        parse_job(raw, base_dir=base)
    return str(e.value)


def test_defaults_and_relative_paths(tmp_path):
    f = tmp_path / "sub" / "job.yaml"
    f.parent.mkdir()
    f.write_text("model: ../models/m\nadapters: {rev: /abs/rev}\n"
                 "input: {path: 'data/*.parquet', adapter_column: adapter}\noutput: {path: out}\n")
    spec = load_job(f)
    assert spec.model == str(tmp_path / "models" / "m")
    assert spec.adapters == {"rev": "/abs/rev"}
    assert spec.input.path == str(tmp_path / "sub" / "data" / "*.parquet")
    assert spec.output.path == str(tmp_path / "sub" / "out")
    assert spec.input.prompt_column == "prompt" and spec.input.id_column is None
    assert spec.sampling.max_tokens == 64 and spec.sampling.temperature == 0.0
    assert spec.engine.device == "auto" and spec.engine.max_num_seqs == "auto" and spec.engine.enforce_eager is False
    assert spec.on_error == "skip"
    assert spec.job_file == str(f)


def test_env_vars_expand(monkeypatch):
    monkeypatch.setenv("SCRATCH", "/scratch/me")
    spec = parse_job(job(output={"path": "$SCRATCH/out"}), base_dir="/jobs")
    assert spec.output.path == "/scratch/me/out"


@pytest.mark.parametrize("raw, needle", [
    (job(bogus=1), "bogus: unknown field"),
    (job(input={"path": "x", "prompt_colum": "p"}), "input.prompt_colum: unknown field"),
    (job(engine={"max_num_seq": 4}), "engine.max_num_seq: unknown field"),
    (job(sampling={"max_tokens": "64"}), "sampling.max_tokens: expected an integer, got '64' (str)"),
    (job(sampling={"max_tokens": 3.5}), "sampling.max_tokens: expected an integer"),
    (job(sampling={"temperature": "hot"}), "sampling.temperature: expected a number"),
    (job(engine={"enforce_eager": "yes"}), "engine.enforce_eager: expected true or false"),
    (job(engine={"max_num_seqs": True}), "engine.max_num_seqs: expected an integer, got True (bool)"),
    (job(model=3), "model: expected a string, got 3 (int)"),
    (job(input="data.parquet"), "input: expected a mapping, got 'data.parquet' (str)"),
    ({"input": {"path": "x"}, "output": {"path": "o"}}, "model: required field is missing (expected a string)"),
    ({"model": "m", "input": {"path": "x"}, "output": {}}, "output.path: required field is missing"),
    (job(input={"path": "x", "messages_column": "m", "prompt_column": "p"}), "not both"),
    (job(adapters={"rev": "r"}), "input.adapter_column: adapters are configured"),
    (job(adapters={"rev": 5}, input={"path": "x", "adapter_column": "a"}), "adapters.rev: expected a string"),
    (job(engine={"device": "tpu"}), "engine.device: expected one of auto, cpu, cuda, got 'tpu'"),
    (job(engine={"dtype": "int8"}), "engine.dtype: expected one of"),
    (job(engine={"max_model_len": 0}), "engine.max_model_len: must be >= 1"),
    (job(sampling={"top_p": 0}), "sampling.top_p: must be in (0, 1]"),
    (job(sampling={"max_tokens": 4096}, engine={"max_model_len": 2048}),
     "sampling.max_tokens: must be smaller than engine.max_model_len (2048)"),
    (job(engine={"max_model_len": "long"}), "engine.max_model_len: expected an integer, got 'long' (str); or auto"),
    (job(on_error="ignore"), "on_error: expected skip"),
    (job(input={"path": "x", "rows_per_unit": 0}), "input.rows_per_unit: must be >= 1"),
    (job(input={"path": ""}), "input.path: must not be empty"),
    ([1, 2], "job file: expected a mapping"),
])
def test_errors_name_field_and_type(raw, needle):
    assert needle in err(raw)


def test_load_job_prefixes_file_and_reports_yaml_errors(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("model: m\ninput: {path: x}\noutput: {path: o}\nengine: {max_num_seqs: lots}\n")
    with pytest.raises(ConfigError, match=f"{f}: engine.max_num_seqs: expected an integer"):
        load_job(f)
    f.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job(f)
    with pytest.raises(ConfigError, match="cannot read job file"):
        load_job(tmp_path / "missing.yaml")


def test_messages_column_disables_default_prompt_column():
    spec = parse_job(job(input={"path": "x", "messages_column": "chat"}), base_dir="/")
    assert spec.input.prompt_column is None and spec.input.messages_column == "chat"


def test_engine_enable_prefix_caching(monkeypatch):
    assert parse_job(job(), base_dir="/jobs").engine.enable_prefix_caching is True
    off = parse_job(job(engine={"enable_prefix_caching": False}), base_dir="/jobs")
    assert off.engine.enable_prefix_caching is False
    assert "engine.enable_prefix_caching: expected true or false" in \
        err(job(engine={"enable_prefix_caching": "no"}))
    # the job's value reaches the engine's config
    from batchrun.engine.engine import Engine
    from batchrun.job.run.runner import load_engine
    seen = []
    monkeypatch.setattr(Engine, "from_config", classmethod(lambda cls, cfg, adapters=None: seen.append(cfg)))
    load_engine(off)
    assert seen[0].enable_prefix_caching is False
