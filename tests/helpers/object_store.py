"""The output protocol's checks on an object store, for tests/s3 and tests/gcs alike.

``bucket``: tests/s3's Bucket or tests/gcs's GcsBucket (uri, put_rows, write, read, list_keys).
Each crashing run is a forked child of the CLI with the FakeEngine that dies with os._exit(137)
(as abruptly as kill -9) at a named point (tests/helpers/fake_cli.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from batchrun.job.exit_codes import ExitCode
from batchrun.job.storage.registry import storage_for
from batchrun.job.store.objects.lease import Leases
from batchrun.job.store.verify import verify_output
from tests.helpers.jobs import demo_rows, fork_cli
from tests.s3.helpers import job_file, keys, read_parts

ROWS = 14  # 3 shards (base, reverse, upper) in units of 2: 8 units
REPO = Path(__file__).resolve().parents[2]


def crash(job, crash_at, *extra) -> int:
    proc = fork_cli(["run", job, "--no-progress", *extra], crash_at=crash_at)
    proc.join(120)
    return proc.exitcode


def finish(job, *extra) -> int:
    proc = fork_cli(["run", job, "--no-progress", *extra])
    proc.join(120)
    return proc.exitcode


def exactly_once(bucket, prefix: str, rows: int = ROWS) -> None:
    ids = [r["id"] for r in read_parts(bucket, prefix).to_pylist()]
    assert sorted(ids) == list(range(rows)), sorted(ids)
    text, code = verify_output(bucket.uri(prefix))
    assert code == ExitCode.OK, text


def check_kill_then_rerun(bucket, tiny_model, tmp_path, point: str) -> None:
    """Killed at ``point``, then run again: every id exactly once."""
    bucket.put_rows("in/a.parquet", demo_rows(ROWS))
    job = job_file(tmp_path, tiny_model, bucket.uri("in"), bucket.uri("o"), rows_per_unit=2)
    assert crash(job, point) == 137, f"{point} was never reached: nothing was tested"
    assert finish(job) == 0
    exactly_once(bucket, "o")


def check_restart_killed(bucket, tiny_model, tmp_path, point: str, mark_written: bool) -> None:
    """A --restart killed at ``point``: any later run finishes the wipe (when its mark was
    written) and plans the new job; the user's own keys survive."""
    bucket.put_rows("in/a.parquet", demo_rows(ROWS))
    job = job_file(tmp_path, tiny_model, bucket.uri("in"), bucket.uri("o"), rows_per_unit=3)
    assert finish(job) == 0
    bucket.write("o/part-mine.parquet", b"user's")
    job2 = job_file(tmp_path, tiny_model, bucket.uri("in"), bucket.uri("o"), name="job2.yaml", rows_per_unit=2)
    assert crash(job2, point, "--restart") == 137, f"{point} was never reached"
    assert ("o/_batchrun/restarting.json" in keys(bucket, "o/")) == mark_written
    if mark_written:  # any run finishes the interrupted wipe first, then plans the new job
        assert finish(job2) == 0
    else:  # no restart began: the old job is still there, and only --restart replaces it
        proc = fork_cli(["run", job2, "--no-progress"])
        proc.join(120)
        assert proc.exitcode == ExitCode.JOB_CHANGED
        assert finish(job2, "--restart") == 0
    exactly_once(bucket, "o")
    names = keys(bucket, "o/")
    assert "o/part-mine.parquet" in names and "o/_batchrun/restarting.json" not in names
    assert sum(k.startswith("o/part-0") for k in names) == 8


def check_two_workers(bucket, tiny_model, tmp_path, rows: int) -> None:
    """Two workers on one prefix, running at once: every id once, both did work, both runs'
    metrics merged (compare-and-swap on metrics.json)."""
    bucket.put_rows("in/a.parquet", demo_rows(rows))
    job = job_file(tmp_path, tiny_model, bucket.uri("in"), bucket.uri("o"), rows_per_unit=3)
    env = {"FAKE_ENGINE_SLEEP": "0.04"}  # enough work per row that both workers run at once
    procs = [fork_cli(["run", job, "--no-progress", "--task-id", str(t), "--num-tasks", "2"], env=env)
             for t in range(2)]
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    exactly_once(bucket, "o", rows)
    metrics = json.loads(bucket.read("o/_batchrun/metrics.json"))
    assert metrics["units_committed"] == metrics["units_total"] and metrics["complete"]
    assert set(metrics["tasks"]) == {"task-0", "task-1"}  # both merges landed: neither run went missing
    workers = {json.loads(bucket.read(k))["worker"] for k in keys(bucket, "o/_batchrun/commits/")}
    assert workers == {"0", "1"}, workers  # both did work


def check_workers_pool(bucket, tiny_model, tmp_path) -> None:
    """`run --workers 2` on a prefix: forked children share the units, and the pool's progress
    line counts the prefix's commit markers against its manifest."""
    bucket.put_rows("in/a.parquet", demo_rows(24))
    job = job_file(tmp_path, tiny_model, bucket.uri("in"), bucket.uri("w"), rows_per_unit=4)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FAKE_ENGINE_SLEEP": "0.01", "BATCHRUN_CLAIM_LEASE": "2", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "fake_cli.py"), "run", str(job),
                        "--workers", "2"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "units 6/6 committed" in r.stderr, r.stderr[-2000:]
    exactly_once(bucket, "w", 24)


def leases(bucket, lease_s: float, token: str) -> Leases:
    return Leases(storage_for(bucket.uri("x")), lease_s, {"host": "h", "pid": 1, "worker": token, "token": token})


def check_live_lease_refused_stale_one_taken_over_once(bucket) -> None:
    path = bucket.uri("lease")
    a, b, c = leases(bucket, 1.0, "a"), leases(bucket, 1.0, "b"), leases(bucket, 1.0, "c")
    held, _, _ = a.acquire(path)
    assert held is not None
    got, record, _ = b.acquire(path)
    assert got is None and record["token"] == "a"
    assert a.renew(held) and a.mine(held)
    time.sleep(2.2)  # the store's clock moves past the object's time + lease (its Date has 1 s steps)
    results = []
    threads = [threading.Thread(target=lambda t=t: results.append(t.acquire(path))) for t in (b, c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r[0] is not None]
    assert len(winners) == 1 and winners[0][2] is True  # one taker, and it says it took over
    assert not a.mine(held) and not a.renew(held)  # the old owner learns it lost the lease
    a.release(held)  # releasing a lost lease deletes nothing
    winner = b if b.mine(winners[0][0]) else c
    assert winner.mine(winners[0][0])


def check_renewal_defeats_a_stale_take_over(bucket) -> None:
    """The race the conditional write closes: a taker that read the lease before its owner renewed
    it holds an old version (each renewal rewrites the bytes), so its take-over fails."""
    path = bucket.uri("race")
    owner, taker = leases(bucket, 1.0, "owner"), leases(bucket, 1.0, "taker")
    held, _, _ = owner.acquire(path)
    time.sleep(2.2)
    store = storage_for(path)
    stale = store.get(path)
    assert taker.stale(stale, None)
    assert owner.renew(held)  # the owner wakes up and renews ...
    assert store.put(path, taker.body(), if_match=stale.etag) is None  # ... so the stale read cannot win
    assert owner.mine(held)


def check_cli_reports_and_damage(bucket, env: dict, tiny_model, tmp_path) -> tuple[str, str]:
    """`run`, then `verify` (0), `status` (0, complete) and `show` on the prefix through the CLI,
    then a part changed behind batchrun's back: `verify` says DAMAGED (8) naming the unit.
    Returns (the job file, the output URI)."""
    from tests.helpers.jobs import run_cli
    bucket.put_rows("in/a.parquet", demo_rows(10))
    job = job_file(tmp_path, tiny_model, bucket.uri("in"), bucket.uri("o"))
    r = run_cli("run", job, "--no-progress", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = bucket.uri("o")
    v = run_cli("verify", out, env=env)
    assert v.returncode == 0 and "verified: 3/3 units (10 rows)" in v.stdout, v.stdout + v.stderr
    st = run_cli("status", out, env=env)
    assert st.returncode == 0 and "units:   3/3 committed" in st.stdout and "complete" in st.stdout, \
        st.stdout + st.stderr
    sh = run_cli("show", out, "--limit", "3", "--prompts", env=env)
    assert sh.returncode == 0 and sh.stdout.count("id=") == 3 and "prompt=" in sh.stdout, sh.stdout + sh.stderr
    bucket.write("o/part-000001.parquet", b"PAR1 not a part PAR1")
    v = run_cli("verify", out, env=env)
    assert v.returncode == 8 and "unit 1:" in v.stdout, v.stdout + v.stderr
    return job, out


def run_in_process(job, **kw):
    """`batchrun run` in this process with the FakeEngine; its TaskStats."""
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.run.runner import run_job
    from tests.helpers.fake_engine import FakeEngine
    return run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None, **kw)


def check_restart_deletes_only_own_keys(bucket, tiny_model, tmp_path) -> None:
    """--restart with another job deletes the old job's keys and nothing else under or beside the
    prefix (a user's files, a sibling prefix)."""
    bucket.put_rows("in/a.parquet", demo_rows(10))
    run_in_process(job_file(tmp_path, tiny_model, bucket.uri("in"), bucket.uri("o")))
    for key in ("o/part-mine.parquet", "o/notes/readme.txt", "o-sibling/part-000000.parquet"):
        bucket.write(key, b"user's own")
    job = job_file(tmp_path, tiny_model, bucket.uri("in"), bucket.uri("o"), "job2.yaml", rows_per_unit=5)
    st = run_in_process(job, restart=True)
    assert st.units_done == st.units_total == 3  # 10 rows in 3 shards (base, reverse, upper) of <= 5
    names = keys(bucket, "o")
    assert {"o/part-mine.parquet", "o/notes/readme.txt", "o-sibling/part-000000.parquet"} <= set(names)
    assert [k for k in names if k.startswith("o/part-0")] == [f"o/part-00000{i}.parquet" for i in range(3)]
    assert "o/_batchrun/restarting.json" not in names
    assert sorted(r["id"] for r in read_parts(bucket, "o").to_pylist()) == list(range(10))
