"""Jobs with gs:// input and output against the test GCS server: the same results as local paths,
the same discovery rule (object, glob, prefix), pins by generation, resume, --restart,
verify/status/show, and exit 7 naming the URI."""
from __future__ import annotations

import pytest

from tests.gcs.conftest import gcs_env
from tests.helpers.object_store import check_cli_reports_and_damage, check_restart_deletes_only_own_keys, run_in_process
from tests.helpers.jobs import demo_rows, read_output, run_cli, write_rows
from tests.s3.helpers import job_file, keys, read_parts, sorted_rows


run = run_in_process


def test_gcs_in_gcs_out_equals_local_in_local_out(gcs, tiny_model, tmp_path):
    rows = demo_rows(37)
    rows[4]["prompt"] = ""  # an error row travels the same way
    gcs.put_rows("in/a.parquet", rows[:20], row_group_size=6)
    gcs.put_rows("in/sub/b.parquet", rows[20:], row_group_size=6)
    gcs.write("in/_SUCCESS", b"")
    write_rows(tmp_path / "in" / "a.parquet", rows[:20], row_group_size=6)
    write_rows(tmp_path / "in" / "sub" / "b.parquet", rows[20:], row_group_size=6)
    st = run(job_file(tmp_path, tiny_model, gcs.uri("in"), gcs.uri("runs/out"), "gcs.yaml"))
    run(job_file(tmp_path, tiny_model, "in", "out", "local.yaml"))
    n = st.units_total
    assert st.units_done == n > 3
    assert sorted_rows(read_parts(gcs, "runs/out")) == sorted_rows(read_output(tmp_path / "out"))
    names = keys(gcs, "runs/out/")
    assert sum(k.startswith("runs/out/part-") for k in names) == n
    assert sum(k.startswith("runs/out/_batchrun/commits/unit-") for k in names) == n
    assert not any("/claims/" in k for k in names), names  # every claim released
    again = run(job_file(tmp_path, tiny_model, gcs.uri("in"), gcs.uri("runs/out"), "gcs.yaml"))
    assert again.units_skipped == n and again.units_done == 0  # inputs pinned by generation, parts by generation


@pytest.mark.parametrize("written,files", [
    ("one.parquet", ["one.parquet"]),
    ("g/x*.parquet", ["g/x1.parquet", "g/x2.parquet"]),
    ("g/**/x*.parquet", ["g/d/x3.parquet", "g/x1.parquet", "g/x2.parquet"]),
    ("g", ["g/d/x3.parquet", "g/x1.parquet", "g/x2.parquet", "g/y.parquet"]),
])
def test_an_object_a_glob_or_a_prefix_as_input(gcs, tiny_model, tmp_path, written, files):
    from batchrun.job.inputs.files import find_input_files
    from batchrun.job.jobfile.spec import parse_job
    for i, key in enumerate(["one.parquet", "g/x1.parquet", "g/x2.parquet", "g/y.parquet", "g/d/x3.parquet",
                             "g/_x4.parquet"]):
        gcs.put_rows(key, demo_rows(2, start=10 * i))
    spec = parse_job({"model": tiny_model["model"], "input": {"path": gcs.uri(written), "id_column": "id",
                      "prompt_column": "prompt"}, "output": {"path": "out"}, "engine": {"device": "cpu"}}, "/tmp")
    assert find_input_files(spec.input)[0] == [gcs.uri(f) for f in files]


def test_replaced_input_object_is_a_changed_job(gcs, tiny_model, tmp_path):
    from batchrun.errors import JobChanged
    gcs.put_rows("p/a.parquet", demo_rows(8))
    job = job_file(tmp_path, tiny_model, gcs.uri("p"), gcs.uri("o"))
    run(job)
    gcs.put_rows("p/a.parquet", demo_rows(8))  # the same bytes, a new generation
    with pytest.raises(JobChanged, match="input files"):
        run(job)


def test_a_damaged_part_is_rewritten(gcs, tiny_model, tmp_path):
    gcs.put_rows("in/a.parquet", demo_rows(10))
    job = job_file(tmp_path, tiny_model, gcs.uri("in"), gcs.uri("o"))
    run(job)
    want = sorted_rows(read_parts(gcs, "o"))
    gcs.write("o/part-000001.parquet", b"garbage")
    st = run(job)
    assert st.units_repaired == 1 and st.units_done == 1 and sorted_rows(read_parts(gcs, "o")) == want


def test_restart_deletes_only_the_jobs_own_keys(gcs, tiny_model, tmp_path):
    check_restart_deletes_only_own_keys(gcs, tiny_model, tmp_path)


@pytest.mark.slow
def test_cli_run_verify_status_show_and_exit_7_naming_the_uri(gcs, tiny_model, tmp_path):
    env = gcs_env(gcs.endpoint)
    job, _ = check_cli_reports_and_damage(gcs, env, tiny_model, tmp_path)
    missing = job_file(tmp_path, tiny_model, "gs://batchrun-no-such-bucket/in/", gcs.uri("o2"), "missing.yaml")
    r = run_cli("run", missing, "--no-progress", env=env)
    assert r.returncode == 7 and "gs://batchrun-no-such-bucket/in/: NoSuchBucket" in r.stderr, r.stderr
    r = run_cli("status", "gs://batchrun-no-such-bucket/o", env=env)
    assert r.returncode == 7 and "gs://batchrun-no-such-bucket/o/_batchrun/manifest.json: NoSuchBucket" in r.stderr, \
        r.stderr
    r = run_cli("run", job, "--no-progress", env={**env, "AWS_MAX_ATTEMPTS": "1",
                                                  "STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"})
    assert r.returncode == 7 and f"{gcs.uri('in')}: Unreachable" in r.stderr, r.stdout + r.stderr
