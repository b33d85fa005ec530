"""job.yaml with URIs: input.path keeps s3:// as written; model/adapters refuse URIs;
storage_options are checked field by field (no server needed)."""
from __future__ import annotations

import pytest

from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import parse_job
from batchrun.job.storage.options import StorageOptions


def job(**over):
    raw = {"model": "/models/m", "input": {"path": "s3://bucket/prompts/"}, "output": {"path": "out"}}
    for k, v in over.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    return parse_job(raw, "/work/jobs")


def test_input_uri_is_kept_as_written_and_local_paths_resolve_as_before():
    spec = job()
    assert spec.input.path == "s3://bucket/prompts/"
    assert spec.output.path == "/work/jobs/out"
    assert job(input={"path": "s3://bucket/a/**/x*.parquet"}).input.path == "s3://bucket/a/**/x*.parquet"
    assert job(input={"path": "data"}).input.path == "/work/jobs/data"


@pytest.mark.parametrize("field,value,match", [
    ("model", "s3://bucket/model", r"model: s3://bucket/model is a URI; the model directory must be a local path"),
    ("adapters", {"a": "gs://bucket/lora"}, r"adapters.a: gs://bucket/lora is a URI; adapter directories"),
])
def test_model_and_adapter_uris_are_refused_with_the_fix(field, value, match):
    over = {field: value}
    if field == "adapters":
        over["input"] = {"path": "s3://bucket/p", "adapter_column": "adapter"}
    with pytest.raises(ConfigError, match=match):
        job(**over)


@pytest.mark.parametrize("path,match", [
    ("http://host/data", r"input.path: http://host/data uses http://, which batchrun cannot read"),
    ("s3:///key", r"input.path: s3:///key names no bucket"),
    ("s3://bucket//key", r"empty path component"),
])
def test_bad_uris_name_the_field(path, match):
    with pytest.raises(ConfigError, match=match):
        job(input={"path": path})


def test_storage_options_fields():
    spec = job(input={"storage_options": {"endpoint_url": "http://127.0.0.1:9000", "region": "eu-west-1",
                                          "profile": "batch"}})
    assert spec.input.storage_options == StorageOptions("http://127.0.0.1:9000", "eu-west-1", "batch")
    assert job().input.storage_options == StorageOptions()
    with pytest.raises(ConfigError, match=r"input.storage_options.secret_access_key: unknown field \(credentials"):
        job(input={"storage_options": {"secret_access_key": "x"}})
    with pytest.raises(ConfigError, match=r"input.storage_options.endpoint_url: 'localhost:9000' must start"):
        job(input={"storage_options": {"endpoint_url": "localhost:9000"}})
    with pytest.raises(ConfigError, match=r"output.storage_options.region: expected a non-empty string"):
        job(output={"storage_options": {"region": ""}})


@pytest.mark.slow
def test_slurm_script_for_an_s3_output_keeps_task_logs_next_to_the_script(tmp_path):
    from tests.helpers.jobs import run_cli, write_job
    job = write_job(tmp_path / "job.yaml", {"model": "m", "input": {"path": "s3://b/in"},
                                            "output": {"path": "s3://b/$BATCHRUN_T/out"}})
    r = run_cli("slurm", job, "--array", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    log = f"{tmp_path}/job-<array job id>_<task id>.out"
    assert f"task logs go to {log}" in r.stdout
    text = (tmp_path / "job.sbatch").read_text()
    assert f"#SBATCH --output={tmp_path}/job-%A_%a.out" in text
    assert "s3:/" not in text.replace("s3://", "")  # never a URI collapsed into a local path
    assert "mkdir" not in text and "exec >>" not in text  # no log folder under the output
