"""A whole job reading its prompts from S3 equals the same job reading the same files locally."""
from __future__ import annotations

import pytest

from batchrun.job.jobfile.spec import load_job
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, read_output, run_cli, write_rows
from tests.s3.helpers import job_file
from tests.s3.conftest import s3_env


def _job(tmp_path, tiny_model, input_path, name="job.yaml", out="out", **inp):
    return job_file(tmp_path, tiny_model, input_path, out, name, **inp)


def _rows(table):
    return sorted(table.to_pylist(), key=lambda r: r["id"])


def test_s3_input_job_equals_local_input_job(s3, tiny_model, tmp_path):
    rows = demo_rows(37)
    rows[4]["prompt"] = ""  # an error row travels the same way
    s3.put_rows("prompts/a.parquet", rows[:20], row_group_size=6)
    s3.put_rows("prompts/b.parquet", rows[20:], row_group_size=6)
    write_rows(tmp_path / "local" / "a.parquet", rows[:20], row_group_size=6)
    write_rows(tmp_path / "local" / "b.parquet", rows[20:], row_group_size=6)
    results = []
    for name, path in (("s3", s3.uri("prompts/")), ("local", "local")):
        spec = load_job(_job(tmp_path, tiny_model, path, f"{name}.yaml", f"out-{name}"))
        stats = run_job(spec, engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None)
        assert stats.units_done == stats.units_total > 1
        results.append(_rows(read_output(tmp_path / f"out-{name}")))
    assert results[0] == results[1]
    assert len(results[0]) == 37 and sum(r["finish_reason"] == "error" for r in results[0]) == 1
    # a rerun resumes: the inputs are pinned by ETag and still match
    stats = run_job(load_job(tmp_path / "s3.yaml"), engine_factory=FakeEngine.from_spec, progress=False,
                    log=lambda m: None)
    assert stats.units_skipped == stats.units_total and stats.units_done == 0


def test_replaced_input_object_is_a_changed_job(s3, tiny_model, tmp_path):
    s3.put_rows("p/a.parquet", demo_rows(8))
    job = _job(tmp_path, tiny_model, s3.uri("p"))
    run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None)
    s3.put_rows("p/a.parquet", demo_rows(8, start=50))
    from batchrun.errors import JobChanged
    with pytest.raises(JobChanged, match="input files"):
        run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None)


@pytest.mark.slow
def test_cli_plan_run_and_exit_7_naming_the_uri(s3, tiny_model, tmp_path):
    s3.put_rows("cli/a.parquet", demo_rows(9))
    env = s3_env(s3.endpoint)
    job = _job(tmp_path, tiny_model, s3.uri("cli"))
    plan = run_cli("plan", job, env=env)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "9" in plan.stdout
    run = run_cli("run", job, "--no-progress", env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert read_output(tmp_path / "out").num_rows == 9
    missing = _job(tmp_path, tiny_model, "s3://batchrun-no-such-bucket/cli/", "missing.yaml", "out2")
    for cmd in ("plan", "run"):
        r = run_cli(cmd, missing, env=env)
        assert r.returncode == 7, (cmd, r.stdout + r.stderr)
        assert "s3://batchrun-no-such-bucket/cli/: NoSuchBucket" in r.stderr, r.stderr
    bad_key = run_cli("run", job, "--no-progress", "--restart",
                      env={**env, "AWS_MAX_ATTEMPTS": "1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert bad_key.returncode == 7, bad_key.stdout + bad_key.stderr
    assert f"{s3.uri('cli')}: Unreachable" in bad_key.stderr, bad_key.stderr
