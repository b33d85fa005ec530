"""metrics.json is a merge of every task's metrics/task-N.json; two tasks finishing together must
not lose one another's entry. Here another process holds the merge lock, adds task 1's file and
only then lets go: task 0's merge has to wait and see it. Without the lock task 0 read the
directory at once and wrote a metrics.json with task 0 alone (the CI failure of 2026-12-07 in
test_two_tasks_write_disjoint_units_covering_every_row)."""
import json
import multiprocessing as mp
import os
import time

import pytest

from batchrun.job.store import metrics
from batchrun.job.store.commit import write_json_atomic
from batchrun.job.store.lock import LockBusy, TaskLock
from batchrun.job.store.layout import OutputDir


def _hold_merge_then_add_task_1(path: str, ready, hold_s: float) -> None:
    out = OutputDir(path)
    lock = TaskLock(os.path.join(out.locks, "metrics.lock"), "merging metrics.json").acquire()
    ready.set()
    time.sleep(hold_s)
    os.makedirs(out.task_metrics_dir, exist_ok=True)
    write_json_atomic(os.path.join(out.task_metrics_dir, "task-1.json"), {"task_id": 1, "runs": []})
    lock.release()


def _other_holds_the_lock(out: OutputDir, hold_s: float):
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_merge_then_add_task_1, args=(out.path, ready, hold_s))
    p.start()
    assert ready.wait(30)
    return p


def test_a_merge_waits_for_the_one_in_flight(tmp_path):
    out = OutputDir(str(tmp_path / "out"))
    p = _other_holds_the_lock(out, hold_s=0.5)
    t0 = time.monotonic()
    metrics.write_metrics(out, 0, {"task_id": 0}, total_units=3, total_rows=9)
    waited = time.monotonic() - t0
    p.join(30)
    assert p.exitcode == 0
    with open(out.metrics) as f:
        merged = json.load(f)
    assert set(merged["tasks"]) == {"task-0", "task-1"}, merged["tasks"]
    assert waited >= 0.3  # it waited for the holder, not for nothing
    assert not merged["complete"] and merged["units_total"] == 3


def test_a_merge_that_cannot_get_the_lock_raises_lock_busy_after_the_wait(tmp_path, monkeypatch):
    # The runner turns this into a warning (metrics never fail a run); task-0.json is written.
    out = OutputDir(str(tmp_path / "out"))
    monkeypatch.setattr(metrics, "MERGE_WAIT_S", 0.2)
    p = _other_holds_the_lock(out, hold_s=2.0)
    with pytest.raises(LockBusy, match="merging metrics.json"):
        metrics.write_metrics(out, 0, {"task_id": 0}, total_units=3, total_rows=9)
    p.join(30)
    assert os.path.exists(os.path.join(out.task_metrics_dir, "task-0.json"))
    assert not os.path.exists(out.metrics)
