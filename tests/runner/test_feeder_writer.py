"""The feeder and writer threads: lazy, bounded, in order, and their errors reach the engine
thread with their own type and message (unit level, then through a streamed run)."""
import errno
import json
import os
import threading
import time

import pytest

import batchrun.job.store.commit as commit
import batchrun.job.run.runner as runner
from batchrun.errors import OutputIOError
from batchrun.job.run.feeder import END, Feeder, UnitSource
from batchrun.job.jobfile.spec import load_job
from batchrun.job.plan.units import Unit
from batchrun.job.inputs.rows import UnitWork
from batchrun.job.run.runner import RowFailure, run_job
from batchrun.job.run.writer import Writer
from tests.helpers.faults import commits, N_ROWS
from tests.helpers.jobs import demo_rows
from tests.helpers.fake_engine import FakeEngine


def _work(i, rows=4, requests=True):
    from batchrun.engine.request import Request
    unit = Unit(i, None, True, 4 * i, rows)
    reqs = [Request((i, p), [1, 2]) for p in range(rows)] if requests else []
    return UnitWork(unit, list(range(rows)), [None] * rows, reqs)


class OneShot:
    """An iterable that can be walked once and has no len() or indexing (a lazy claim iterator)."""

    def __init__(self, n):
        self.n, self.pulled, self.walked = n, 0, False

    def __iter__(self):
        assert not self.walked, "walked twice"
        self.walked = True
        for i in range(self.n):
            self.pulled += 1
            yield Unit(i, None, True, 4 * i, 4)


def _wait_until(cond, timeout=10.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def test_feeder_pulls_lazily_and_stays_bounded():
    units = OneShot(50)
    built = []
    feeder = Feeder(units, lambda u: (built.append(u.index), _work(u.index))[1], ahead_rows=10).start()
    try:
        _wait_until(lambda: len(built) >= 3)
        time.sleep(0.1)
        assert len(built) == 3 and units.pulled <= 4  # 3 units = 12 rows >= 10: it waits
        got = [feeder.get(wait=True).unit.index for _ in range(5)]
        assert got == [0, 1, 2, 3, 4]
        _wait_until(lambda: len(built) >= 8)
        time.sleep(0.1)
        assert len(built) == 8  # again 3 ahead of the consumer
    finally:
        feeder.close()
    assert len(built) < 50


def test_feeder_error_comes_after_the_units_before_it_with_its_type():
    class Broken(Exception):
        pass

    def build(u):
        if u.index == 3:
            raise Broken("unit 3 is unreadable")
        return _work(u.index)
    feeder = Feeder(OneShot(10), build, ahead_rows=1000).start()
    assert [feeder.get(wait=True).unit.index for _ in range(3)] == [0, 1, 2]
    with pytest.raises(Broken, match="unit 3 is unreadable"):
        feeder.get(wait=True)
    feeder.close()

    # through the engine's source: the error ends the source after units 0-2, kept for the caller
    seen = []
    src = UnitSource(Feeder(OneShot(10), build, ahead_rows=1000).start(), lambda w: seen.append(w.unit.index))
    taken = []
    while (got := src.take(5, wait=True)) is not None:
        taken += got
    assert seen == [0, 1, 2] and len(taken) == 12
    assert isinstance(src.error, Broken) and src.get(wait=True) is END
    src.feeder.close()


def test_unit_source_does_not_block_while_the_engine_has_work():
    gate = threading.Event()

    def build(u):
        if u.index == 1:
            gate.wait(10)
        return _work(u.index)
    src = UnitSource(Feeder(OneShot(3), build, ahead_rows=1000).start(), lambda w: None)
    assert len(src.take(4, wait=True)) == 4  # unit 0
    t0 = time.time()
    assert src.take(4, wait=False) == []  # unit 1 is still being read: nothing ready, no wait
    assert time.time() - t0 < 1.0
    gate.set()
    assert len(src.take(4, wait=True)) == 4
    src.feeder.close()


def test_writer_commits_in_order_off_thread_and_reraises_its_error():
    done, threads = [], set()

    def commit_(w):
        threads.add(threading.current_thread().name)
        if w.unit.index == 2:
            raise OutputIOError("disk full: cannot commit unit 2")
        done.append(w.unit.index)
    writer = Writer(commit_, max_queued=2).start()
    for i in range(2):
        writer.put(_work(i))
    _wait_until(lambda: writer.backlog == 0)
    assert done == [0, 1] and threads == {"batchrun-writer"}
    writer.put(_work(2))
    _wait_until(lambda: writer.error is not None)
    with pytest.raises(OutputIOError, match="disk full: cannot commit unit 2"):
        writer.put(_work(3))
    with pytest.raises(OutputIOError, match="disk full"):
        writer.close()
    assert done == [0, 1]


# ---- through a streamed run (the FakeEngine, in process) ----------------------------

def _run(job):
    return run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None)


def test_a_feeder_error_lets_the_units_before_it_commit(make_job, tmp_path, monkeypatch):
    orig = runner.build_unit

    def build_unit(unit, *a, **kw):
        if unit.index == 5:
            raise KeyError("unit 5: a reader bug")
        return orig(unit, *a, **kw)
    monkeypatch.setattr(runner, "build_unit", build_unit)
    with pytest.raises(KeyError, match="unit 5: a reader bug"):
        _run(make_job(demo_rows(N_ROWS)))
    assert commits(tmp_path / "out") == [f"unit-{i:06d}.json" for i in range(5)]
    assert os.listdir(tmp_path / "out" / "_batchrun" / "tmp") == []


def test_on_error_fail_streamed_keeps_earlier_units(make_job, tmp_path):
    rows = demo_rows(12)
    rows[7]["prompt"] = ""  # in unit 1 (reverse)
    with pytest.raises(RowFailure, match=r"row id=7: prompt is empty .*\(on_error: fail\)"):
        _run(make_job(rows, on_error="fail"))
    assert commits(tmp_path / "out") == ["unit-000000.json"]


def test_disk_full_in_the_writer_thread_is_output_io_error(make_job, tmp_path, monkeypatch):
    orig = commit.write_part
    calls = []

    def write_part(out, task, unit, table):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return orig(out, task, unit, table)
    monkeypatch.setattr(commit, "write_part", write_part)
    with pytest.raises(OutputIOError, match="cannot commit unit 2"):
        _run(make_job(demo_rows(N_ROWS)))
    assert set(calls) == {"batchrun-writer"}
    assert commits(tmp_path / "out") == ["unit-000000.json", "unit-000001.json"]
    metrics = json.loads((tmp_path / "out" / "_batchrun" / "metrics.json").read_text())
    assert metrics["tasks"]["task-0"]["status"] == "failed"
    assert os.listdir(tmp_path / "out" / "_batchrun" / "tmp") == []
