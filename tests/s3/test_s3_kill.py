"""kill -9 at each point of the S3 output protocol, then a rerun: every id exactly once.

Each crashing run is a forked child of the CLI with the FakeEngine that dies with os._exit(137)
(as abruptly as kill -9) at a named point (tests/helpers/fake_cli.py): before a part's PUT, after
it (before its marker), after a marker, or right before the N-th S3 request of a kind (the
planning lock, plan, manifest, claims, their releases, metrics, restart deletes)."""
from __future__ import annotations

import pytest

from batchrun.job.exit_codes import ExitCode
from tests.helpers.jobs import demo_rows, fork_cli
from tests.helpers.object_store import (ROWS, check_kill_then_rerun, check_restart_killed, check_two_workers,
                                        check_workers_pool, exactly_once, finish)
from tests.s3.helpers import job_file, keys


@pytest.mark.slow
@pytest.mark.parametrize("point", [
    "before_put:1", "before_put:4", "after_put:1", "after_put:5", "after_commit:1", "after_commit:8",
    "s3.put:1", "s3.put:2", "s3.put:4", "s3.put:6", "s3.put:8", "s3.put:11", "s3.put:16",
    "s3.delete:1", "s3.delete:3", "s3.get:3",
])
def test_kill9_at_each_point_then_rerun_gives_every_id_once(s3, tiny_model, tmp_path, point):
    check_kill_then_rerun(s3, tiny_model, tmp_path, point)


@pytest.mark.slow
@pytest.mark.parametrize("point,mark_written", [
    ("s3.put:3", False),  # probe, planning lock, then the restart mark: killed before the mark
    ("s3.delete_many:1", True), ("s3.delete_many:2", True), ("s3.delete_many:3", True),
])
def test_kill9_during_restart_then_rerun(s3, tiny_model, tmp_path, point, mark_written):
    check_restart_killed(s3, tiny_model, tmp_path, point, mark_written)


@pytest.mark.slow
def test_two_workers_on_one_prefix(s3, tiny_model, tmp_path):
    check_two_workers(s3, tiny_model, tmp_path, rows=90)


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
    # it read a local directory and said "units 0/?"
    check_workers_pool(s3, tiny_model, tmp_path)
