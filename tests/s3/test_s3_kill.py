"""kill -9 at each point of the S3 output protocol, then a rerun: every id exactly once.

Each crashing run is a forked child of the CLI with the FakeEngine that dies with os._exit(137)
(as abruptly as kill -9) at a named point (tests/helpers/fake_cli.py): before a part's PUT, after
it (before its marker), after a marker, or right before the N-th S3 request of a kind (the
planning lock, plan, manifest, claims, their releases, metrics, restart deletes)."""
from __future__ import annotations

import pytest

from batchrun.job.store.verify import verify_output
from batchrun.job.exit_codes import ExitCode
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
    assert proc.exitcode == 0
    return proc.exitcode


def exactly_once(s3, prefix: str, rows: int = ROWS) -> None:
    ids = [r["id"] for r in read_parts(s3, prefix).to_pylist()]
    assert sorted(ids) == list(range(rows)), sorted(ids)
    text, code = verify_output(s3.uri(prefix))
    assert code == ExitCode.OK, text


@pytest.mark.slow
@pytest.mark.parametrize("point", [
    "before_put:1", "before_put:4", "after_put:1", "after_put:5", "after_commit:1", "after_commit:8",
    "s3.put:1", "s3.put:2", "s3.put:4", "s3.put:6", "s3.put:8", "s3.put:11", "s3.put:16",
    "s3.delete:1", "s3.delete:3", "s3.get:3",
])
def test_kill9_at_each_point_then_rerun_gives_every_id_once(s3, tiny_model, tmp_path, point):
    s3.put_rows("in/a.parquet", demo_rows(ROWS))
    job = job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o"), rows_per_unit=2)
    assert crash(job, point) == 137, f"{point} was never reached: nothing was tested"
    assert finish(job) == 0
    exactly_once(s3, "o")


@pytest.mark.slow
@pytest.mark.parametrize("point,mark_written", [
    ("s3.put:3", False),  # probe, planning lock, then the restart mark: killed before the mark
    ("s3.delete_many:1", True), ("s3.delete_many:2", True), ("s3.delete_many:3", True),
])
def test_kill9_during_restart_then_rerun(s3, tiny_model, tmp_path, point, mark_written):
    s3.put_rows("in/a.parquet", demo_rows(ROWS))
    job = job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o"), rows_per_unit=3)
    assert finish(job) == 0
    s3.client.put_object(Bucket=s3.name, Key="o/part-mine.parquet", Body=b"user's")
    job2 = job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o"), name="job2.yaml", rows_per_unit=2)
    assert crash(job2, point, "--restart") == 137, f"{point} was never reached"
    assert ("o/_batchrun/restarting.json" in keys(s3, "o/")) == mark_written
    if mark_written:  # any run finishes the interrupted wipe first, then plans the new job
        assert finish(job2) == 0
    else:  # no restart began: the old job is still there, and only --restart replaces it
        proc = fork_cli(["run", job2, "--no-progress"])
        proc.join(120)
        assert proc.exitcode == ExitCode.JOB_CHANGED
        assert finish(job2, "--restart") == 0
    exactly_once(s3, "o")
    names = keys(s3, "o/")
    assert "o/part-mine.parquet" in names and "o/_batchrun/restarting.json" not in names
    assert sum(k.startswith("o/part-0") for k in names) == 8


@pytest.mark.slow
def test_two_workers_on_one_prefix(s3, tiny_model, tmp_path):
    rows = 90  # enough work (FAKE_ENGINE_SLEEP per row) that both workers are running at once
    s3.put_rows("in/a.parquet", demo_rows(rows))
    job = job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o"), rows_per_unit=3)
    env = {"FAKE_ENGINE_SLEEP": "0.04"}
    procs = [fork_cli(["run", job, "--no-progress", "--task-id", str(t), "--num-tasks", "2"], env=env)
             for t in range(2)]
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    exactly_once(s3, "o", rows)
    import json
    metrics = json.loads(s3.client.get_object(Bucket=s3.name, Key="o/_batchrun/metrics.json")["Body"].read())
    assert metrics["units_committed"] == metrics["units_total"] == 30 and metrics["complete"]
    assert set(metrics["tasks"]) == {"task-0", "task-1"}  # both merges landed: neither run went missing
    by_worker = {}
    for k in keys(s3, "o/_batchrun/commits/"):
        w = json.loads(s3.client.get_object(Bucket=s3.name, Key=k)["Body"].read())["worker"]
        by_worker[w] = by_worker.get(w, 0) + 1
    assert set(by_worker) == {"0", "1"}, by_worker  # both did work


@pytest.mark.slow
def test_a_second_run_of_the_same_task_is_refused_while_the_first_runs(s3, tiny_model, tmp_path, monkeypatch):
    """The second run waits to see whether the lock's lease is renewed (a dead holder's is not:
    test_task_lock_of_a_dead_host_is_waited_out) and refuses when it is (exit 6)."""
    monkeypatch.setenv("BATCHRUN_CLAIM_LEASE", "3")
    s3.put_rows("in/a.parquet", demo_rows(ROWS))
    job = job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o"), rows_per_unit=1)
    first = fork_cli(["run", job, "--no-progress"], env={"FAKE_ENGINE_SLEEP": "0.3"})
    import time
    deadline = time.time() + 60
    while time.time() < deadline and not any("/commits/" in k for k in keys(s3, "o/")):
        time.sleep(0.1)
    second = fork_cli(["run", job, "--no-progress"])
    second.join(60)
    assert second.exitcode == ExitCode.LOCKED
    first.join(180)
    assert first.exitcode == 0
    exactly_once(s3, "o")


@pytest.mark.slow
def test_task_lock_of_a_dead_host_is_waited_out(s3, tiny_model, tmp_path, monkeypatch):
    """A lock lease left by a task on another host (a node lost, a task requeued elsewhere) is
    not renewed: the new run waits until it is stale (one lease), takes it over and finishes."""
    import json
    import time
    monkeypatch.setenv("BATCHRUN_CLAIM_LEASE", "3")
    s3.put_rows("in/a.parquet", demo_rows(ROWS))
    job = job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("o"), rows_per_unit=2)
    s3.client.put_object(Bucket=s3.name, Key="o/_batchrun/locks/task-0.lock", Body=json.dumps(
        {"host": "a-node-that-died", "pid": 1, "token": "x", "lease_s": 3}).encode())
    t0 = time.time()
    assert finish(job) == 0
    assert time.time() - t0 >= 2  # it waited for the lease (the store's clock has 1 s steps)
    exactly_once(s3, "o")


@pytest.mark.slow
def test_cpu_workers_pool_on_a_prefix_reports_its_units(s3, tiny_model, tmp_path):
    # `run --workers N` on an s3:// output: the pool's progress line counts the prefix's commit
    # markers against its manifest (it read a local directory and said "units 0/?")
    import os
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    s3.put_rows("in/a.parquet", demo_rows(24))
    job = job_file(tmp_path, tiny_model, s3.uri("in"), s3.uri("w"), rows_per_unit=4)
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FAKE_ENGINE_SLEEP": "0.01", "BATCHRUN_CLAIM_LEASE": "2", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, str(repo / "tests" / "helpers" / "fake_cli.py"), "run", str(job),
                        "--workers", "2"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "units 6/6 committed" in r.stderr, r.stderr[-2000:]
    exactly_once(s3, "w", 24)
