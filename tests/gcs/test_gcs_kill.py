"""kill -9 at points of the output protocol on GCS, then a rerun: every id exactly once; two
workers on one prefix; a restart killed midway. The crash points are tests/helpers/fake_cli.py's
(the store's calls are counted as "store.put:N" etc. whichever store the run uses); tests/s3
covers every point, these the ones whose GCS requests differ (conditional creates, compare-and-
swap renewals, conditional deletes, one delete per object)."""
from __future__ import annotations

import json

import pytest

from batchrun.job.exit_codes import ExitCode
from batchrun.job.store.verify import verify_output
from tests.helpers.jobs import demo_rows, fork_cli
from tests.s3.helpers import job_file, keys, read_parts

ROWS = 14  # 3 shards (base, reverse, upper) in units of 2: 8 units


def crash(job, crash_at, *extra):
    proc = fork_cli(["run", job, "--no-progress", *extra], crash_at=crash_at)
    proc.join(120)
    return proc.exitcode


def finish(job, *extra):
    proc = fork_cli(["run", job, "--no-progress", *extra])
    proc.join(120)
    return proc.exitcode


def exactly_once(gcs, prefix: str, rows: int = ROWS) -> None:
    ids = [r["id"] for r in read_parts(gcs, prefix).to_pylist()]
    assert sorted(ids) == list(range(rows)), sorted(ids)
    text, code = verify_output(gcs.uri(prefix))
    assert code == ExitCode.OK, text


@pytest.mark.slow
@pytest.mark.parametrize("point", [
    "before_put:2", "after_put:3", "after_commit:1", "store.put:2", "store.put:6", "store.delete:2", "store.get:3",
])
def test_kill9_at_a_point_then_rerun_gives_every_id_once(gcs, tiny_model, tmp_path, point):
    gcs.put_rows("in/a.parquet", demo_rows(ROWS))
    job = job_file(tmp_path, tiny_model, gcs.uri("in"), gcs.uri("o"), rows_per_unit=2)
    assert crash(job, point) == 137, f"{point} was never reached: nothing was tested"
    assert finish(job) == 0
    exactly_once(gcs, "o")


@pytest.mark.slow
def test_kill9_during_restart_then_rerun(gcs, tiny_model, tmp_path):
    gcs.put_rows("in/a.parquet", demo_rows(ROWS))
    job = job_file(tmp_path, tiny_model, gcs.uri("in"), gcs.uri("o"), rows_per_unit=3)
    assert finish(job) == 0
    gcs.write("o/part-mine.parquet", b"user's")
    job2 = job_file(tmp_path, tiny_model, gcs.uri("in"), gcs.uri("o"), name="job2.yaml", rows_per_unit=2)
    assert crash(job2, "store.delete_many:2", "--restart") == 137
    assert "o/_batchrun/restarting.json" in keys(gcs, "o/")
    assert finish(job2) == 0  # any run finishes the interrupted wipe first, then plans the new job
    exactly_once(gcs, "o")
    names = keys(gcs, "o/")
    assert "o/part-mine.parquet" in names and "o/_batchrun/restarting.json" not in names
    assert sum(k.startswith("o/part-0") for k in names) == 8


@pytest.mark.slow
def test_two_workers_on_one_prefix(gcs, tiny_model, tmp_path):
    rows = 60  # enough work (FAKE_ENGINE_SLEEP per row) that both workers are running at once
    gcs.put_rows("in/a.parquet", demo_rows(rows))
    job = job_file(tmp_path, tiny_model, gcs.uri("in"), gcs.uri("o"), rows_per_unit=3)
    env = {"FAKE_ENGINE_SLEEP": "0.04"}
    procs = [fork_cli(["run", job, "--no-progress", "--task-id", str(t), "--num-tasks", "2"], env=env)
             for t in range(2)]
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    exactly_once(gcs, "o", rows)
    metrics = json.loads(gcs.read("o/_batchrun/metrics.json"))
    assert metrics["units_committed"] == metrics["units_total"] and metrics["complete"]
    assert set(metrics["tasks"]) == {"task-0", "task-1"}  # both merges landed (compare-and-swap on generation)
    workers = {json.loads(gcs.read(k))["worker"] for k in keys(gcs, "o/_batchrun/commits/")}
    assert workers == {"0", "1"}, workers  # both did work


@pytest.mark.slow
def test_cpu_workers_pool_on_a_gs_prefix(gcs, tiny_model, tmp_path):
    # `run --workers N` on a gs:// output: forked children share the units; the pool's progress
    # line counts the prefix's commit markers against its manifest
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    gcs.put_rows("in/a.parquet", demo_rows(24))
    job = job_file(tmp_path, tiny_model, gcs.uri("in"), gcs.uri("w"), rows_per_unit=4)
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FAKE_ENGINE_SLEEP": "0.01", "BATCHRUN_CLAIM_LEASE": "2", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, str(repo / "tests" / "helpers" / "fake_cli.py"), "run", str(job),
                        "--workers", "2"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "units 6/6 committed" in r.stderr, r.stderr[-2000:]
    exactly_once(gcs, "w", 24)
