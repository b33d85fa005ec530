"""One plan per output directory (issue 14): the first worker plans and publishes; workers that
race it wait and read its plan; a later worker reads the stored plan and neither scans the rows
nor counts tokens nor digests inputs whose size and mtime still match the plan."""
import json
import os
import subprocess
import sys
import time

import pytest

from batchrun.job.plan import prepare as prep
from batchrun.job.inputs import token_count
from batchrun.job.jobfile.spec import load_job
from batchrun.job.store.lock import LockBusy
from tests.helpers.jobs import demo_rows, REPO

RACER = r"""
import json, os, sys, time
from batchrun.job.plan import prepare as prep
from batchrun.job.jobfile.spec import load_job
job, log, ready, go = sys.argv[1:5]
real = prep.make_plan
def slow_plan(*a, **k):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.5)  # the other racer reaches the manifest lock meanwhile
    return real(*a, **k)
prep.make_plan = slow_plan
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
p = prep.prepare(load_job(job), log=lambda m: print(m, file=sys.stderr))
print(json.dumps({"fp": p.fingerprint, "units": [[u.index, u.adapter, u.rows] for u in p.plan.units]}))
"""


@pytest.mark.slow
def test_two_racing_first_workers_publish_one_plan(make_job, tmp_path):
    job = make_job(demo_rows(24))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    log, go = tmp_path / "planned.log", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(job), str(log), str(tmp_path / f"ready{i}"), str(go)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(log.read_text().split()) == 1  # exactly one planned
    results = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert results[0] == results[1]
    assert any("waiting for its plan" in e for _, e in outs), outs  # the other one waited for it


def test_a_later_worker_reads_the_stored_plan_without_scanning(make_job, tmp_path, monkeypatch):
    spec = load_job(make_job(demo_rows(24)))
    first = prep.prepare(spec)

    def forbidden(*a, **k):
        raise AssertionError("a later worker scanned or counted the inputs")

    monkeypatch.setattr(prep, "make_plan", forbidden)
    monkeypatch.setattr(prep, "identity", forbidden)  # size+mtime match: the plan's digests are kept
    monkeypatch.setattr(token_count.Counter, "lengths", forbidden)
    monkeypatch.setattr(token_count.Counter, "chat_lengths", forbidden)
    second = prep.prepare(spec)
    assert second.fingerprint == first.fingerprint
    assert [(u.index, u.adapter, u.rows) for u in second.plan.units] == \
           [(u.index, u.adapter, u.rows) for u in first.plan.units]
    assert [p.digest for p in second.pins.pins] == [p.digest for p in first.pins.pins]


def test_a_touched_input_is_digested_again_not_replanned(make_job, tmp_path, monkeypatch):
    spec = load_job(make_job(demo_rows(24)))
    first = prep.prepare(spec)
    path = first.plan.files[0]
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
    digested = []
    real = prep.identity
    monkeypatch.setattr(prep, "identity", lambda p: digested.append(p) or real(p))
    monkeypatch.setattr(prep, "make_plan", lambda *a, **k: pytest.fail("replanned"))
    second = prep.prepare(spec)
    assert digested == [path] and second.fingerprint == first.fingerprint


def test_a_changed_input_is_still_a_different_job(make_job, tmp_path):
    from batchrun.errors import JobChanged
    from tests.helpers.jobs import write_rows
    spec = load_job(make_job(demo_rows(24)))
    prep.prepare(spec)
    write_rows(tmp_path / "data" / "in.parquet", demo_rows(25))  # new size and mtime
    with pytest.raises(JobChanged):
        prep.prepare(spec)


HOLDER = r"""
import sys, time
from batchrun.job.store.lock import TaskLock
TaskLock(sys.argv[1], "planning").acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_waiting_for_a_hung_planner_is_bounded(make_job, tmp_path, monkeypatch):
    spec = load_job(make_job(demo_rows(8)))
    lock = tmp_path / "out" / "_batchrun" / "locks" / "manifest.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(prep, "PLAN_WAIT_S", 0.5)
        t0 = time.monotonic()
        with pytest.raises(LockBusy) as e:
            prep.prepare(spec)
        assert time.monotonic() - t0 < 10
        assert "waited 0.5 s for another worker to finish planning" in str(e.value)
        assert f"pid {holder.pid}" in str(e.value)
    finally:
        holder.kill()
        holder.wait()
