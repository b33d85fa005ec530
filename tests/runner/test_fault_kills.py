"""kill -9 at chosen system calls of a run and of --restart, and at random moments: afterwards a
plain rerun leaves every id exactly once (issue 9, case 1), and nothing outside batchrun's own
files is touched.

Each crashing run is a forked child of the CLI with the FakeEngine; ``crash_at="os.remove:3"``
kills it (os._exit(137), as abrupt as kill -9) right before its 3rd os.remove call, the way
``strace -e inject=unlink:signal=KILL:when=3`` does.
"""
import os
import random
import signal

import pytest

from tests.helpers.faults import assert_every_id_once, commits, dataset_ids, N_ROWS, wait_for
from tests.helpers.jobs import demo_rows, fork_cli


def run_ok(job, *extra):
    proc = fork_cli(["run", job, "--no-progress", *extra])
    proc.join(120)
    assert proc.exitcode == 0
    return proc


def crash(job, crash_at, *extra, env=None):
    proc = fork_cli(["run", job, "--no-progress", *extra], crash_at=crash_at, env=env)
    proc.join(120)
    return proc.exitcode


# Points inside a plain run: each unit renames its part (os.replace) and then its marker
# (os.replace); odd calls after the manifest's are "between publish and commit".
RUN_POINTS = [f"os.replace:{n}" for n in (1, 2, 3, 4, 7, 10, 17)] + ["os.rename:1", "shutil.rmtree:1"]
# os.write:3: between creating the first unit claim and writing its owner (the two writes
# before it are the run's locks): the rerun must take that empty claim over promptly, not after
# the 120 s lease (it did not: the rerun sat out the lease)
RUN_POINTS += ["os.write:3"]
# Points inside --restart of a finished run: the restart mark (os.replace:1), the markers'
# rmtree (shutil.rmtree:1 / os.unlink:N inside it), the part files (os.remove:N), the metadata.
RESTART_POINTS = ["os.replace:1", "shutil.rmtree:1", "os.unlink:1", "os.unlink:5", "os.remove:1",
                  "os.remove:2", "os.remove:5", "os.remove:9", "shutil.rmtree:2", "shutil.rmtree:3",
                  "os.replace:2"]


@pytest.mark.slow
@pytest.mark.parametrize("point", RUN_POINTS)
def test_kill_at_syscall_during_run_then_rerun(make_job, tmp_path, point):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    code = crash(job, point)
    assert code in (137, 0)
    if out.exists():
        dataset_ids(out)  # readable, whole files only, no duplicates
    run_ok(job)
    assert_every_id_once(out)


@pytest.mark.parametrize("rerun_flags", [(), ("--restart",)])
@pytest.mark.parametrize("point", RESTART_POINTS)
def test_kill_inside_restart_never_loses_rows(make_job, tmp_path, point, rerun_flags):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run_ok(job)
    (out / "notes.txt").write_text("the user's own file")
    (out / "part-mine.parquet").write_bytes(b"the user's own parquet")
    code = crash(job, point, "--restart")
    assert code == 137
    run_ok(job, *rerun_flags)  # a plain rerun finishes an interrupted restart first
    assert_every_id_once(out, extra_ok=("notes.txt", "part-mine.parquet"))
    assert len(commits(out)) == 9
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert (out / "part-mine.parquet").read_bytes() == b"the user's own parquet"
    assert not (out / "_batchrun" / "restarting.json").exists()


def test_kept_commits_without_manifest_plan_or_parts_are_not_trusted(make_job, tmp_path):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run_ok(job)
    import shutil
    os.remove(out / "_batchrun" / "manifest.json")
    shutil.rmtree(out / "_batchrun" / "plan")
    for p in out.glob("part-*.parquet"):
        os.remove(p)
    run_ok(job)
    assert_every_id_once(out)


@pytest.mark.parametrize("seed", range(4))
def test_sigkill_at_random_moments_of_run_and_restart(make_job, tmp_path, seed):
    rng = random.Random(seed)
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run_ok(job)
    for flags in (("--restart",), ()):
        proc = fork_cli(["run", job, "--no-progress", *flags], env={"FAKE_ENGINE_SLEEP": "0.01"})
        wait_for(lambda: (out / "_batchrun").exists())
        import time
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(30)
        dataset_ids(out)
    run_ok(job)
    assert_every_id_once(out)
