"""Outputs on S3: the same results as a local output, resume, restart, verify/status/show."""
from __future__ import annotations

import pytest

from tests.helpers.object_store import check_cli_reports_and_damage, check_restart_deletes_only_own_keys, run_in_process
from tests.helpers.jobs import demo_rows, read_output, write_rows
from tests.s3.helpers import job_file, keys, read_parts, sorted_rows


run = run_in_process


def test_s3_in_s3_out_equals_local_in_local_out(s3, tiny_model, tmp_path):
    rows = demo_rows(37)
    rows[4]["prompt"] = ""
    s3.put_rows("in/a.parquet", rows[:20], row_group_size=6)
    s3.put_rows("in/b.parquet", rows[20:], row_group_size=6)
    write_rows(tmp_path / "in" / "a.parquet", rows[:20], row_group_size=6)
    write_rows(tmp_path / "in" / "b.parquet", rows[20:], row_group_size=6)
    st = run(job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("runs/out"), "s3.yaml"))
    run(job_file(tmp_path, tiny_model, "in", "out", "local.yaml"))
    n = st.units_total
    assert st.units_done == n > 3
    assert sorted_rows(read_parts(s3, "runs/out")) == sorted_rows(read_output(tmp_path / "out"))
    names = keys(s3, "runs/out/")
    assert sum(k.startswith("runs/out/part-") for k in names) == n
    assert sum(k.startswith("runs/out/_batchrun/commits/unit-") for k in names) == n
    assert not any("/claims/" in k or "/tmp/" in k for k in names), names  # released, no temp files
    assert "runs/out/_batchrun/manifest.json" in names and "runs/out/_batchrun/metrics.json" in names
    again = run(job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("runs/out"), "s3.yaml"))
    assert again.units_skipped == n and again.units_done == 0


def test_a_replaced_or_deleted_part_is_rewritten(s3, tiny_model, tmp_path):
    s3.put_rows("in/a.parquet", demo_rows(12))
    job = job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o"))
    run(job)
    want = sorted_rows(read_parts(s3, "o"))
    s3.client.delete_object(Bucket=s3.name, Key="o/part-000001.parquet")
    s3.client.put_object(Bucket=s3.name, Key="o/part-000002.parquet", Body=b"garbage")
    st = run(job)
    assert st.units_repaired == 2 and st.units_done == 2
    assert sorted_rows(read_parts(s3, "o")) == want


def test_output_prefix_rules(s3, tiny_model, tmp_path):
    from batchrun.errors import ConfigError, JobChanged
    s3.put_rows("in/a.parquet", demo_rows(8))
    with pytest.raises(ConfigError, match="lies under the input prefix"):
        run(job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("in/out")))
    with pytest.raises(ConfigError, match="is a whole bucket"):
        run(job_file(tmp_path, tiny_model, s3.uri("in"), f"s3://{s3.name}"))
    s3.client.put_object(Bucket=s3.name, Key="taken/notes.txt", Body=b"mine")
    with pytest.raises(ConfigError, match=r"is not empty and does not hold a batchrun job \(it has notes.txt"):
        run(job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("taken")))
    run(job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o")))
    with pytest.raises(JobChanged, match="different job"):
        run(job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o"), rows_per_unit=3))


def test_restart_deletes_only_the_jobs_own_keys(s3, tiny_model, tmp_path):
    check_restart_deletes_only_own_keys(s3, tiny_model, tmp_path)


@pytest.mark.slow
def test_verify_status_show_on_an_s3_output(s3, tiny_model, tmp_path):
    from tests.helpers.jobs import run_cli
    from tests.s3.conftest import s3_env
    env = s3_env(s3.endpoint)
    _, out = check_cli_reports_and_damage(s3, env, tiny_model, tmp_path)
    assert run_cli("status", out, env=env).returncode == 8
    # an unfinished output: verify says INCOMPLETE (9)
    s3.client.delete_object(Bucket=s3.name, Key="o/_batchrun/commits/unit-000002.json")
    s3.client.delete_object(Bucket=s3.name, Key="o/part-000001.parquet")
    s3.client.delete_object(Bucket=s3.name, Key="o/_batchrun/commits/unit-000001.json")
    v = run_cli("verify", out, env=env)
    assert v.returncode == 9 and "INCOMPLETE" in v.stdout and "part-000002.parquet" in v.stdout, v.stdout
    missing = run_cli("status", "s3://batchrun-no-such-bucket/o", env=env)
    assert missing.returncode == 7 and "s3://batchrun-no-such-bucket/o/_batchrun/manifest.json: NoSuchBucket" in missing.stderr, missing.stderr
