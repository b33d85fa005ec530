"""Signals at any moment (start-up included), a full or read-only disk, damaged metadata and bad
numbers: one `batchrun: error:` line and a documented exit code, never a traceback, and no temp
file left behind (issue 9, cases 8, 9, 10)."""
import errno
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import batchrun.job.store.commit as commit_mod
from batchrun.cli import ExitCode
from batchrun.errors import OutputIOError
from batchrun.job.jobfile.spec import load_job
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.faults import assert_every_id_once, commits, dataset_ids, handlers_installed, N_ROWS, wait_for
from tests.helpers.jobs import demo_rows, fork_cli, REPO, run_cli


def run(job, restart=False):
    return run_job(load_job(job), restart=restart, engine_factory=FakeEngine.from_spec, progress=False,
                   log=lambda m: None)


def one_error_line(stderr: str, needle: str) -> None:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("batchrun: error:")]
    assert len(lines) == 1 and needle in lines[0], stderr
    assert "Traceback" not in stderr and "Aborted!" not in stderr


def leftovers(out) -> list[str]:
    found = []
    for dirpath, _, names in os.walk(out):
        found += [os.path.join(dirpath, n) for n in names if n.endswith(".tmp")]
    return found


# ---- signals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("sig, delay", [(signal.SIGTERM, 0.0), (signal.SIGINT, 0.0), (signal.SIGTERM, 0.3),
                                        (signal.SIGINT, 0.6)])
def test_signal_during_start_up_exits_130_with_one_line(make_job, tmp_path, sig, delay):
    """The real console entry (`python -m batchrun`): the signal lands while click, pyarrow,
    transformers or torch are still being imported, or during the pre-run checks."""
    job = make_job(demo_rows(6))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "batchrun", "run", str(job), "--no-progress"],
                            stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: handlers_installed(proc.pid) or proc.poll() is not None, timeout=30)
    time.sleep(delay)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.INTERRUPTED, err
    one_error_line(err, f"interrupted ({signal.Signals(sig).name})")
    out = tmp_path / "out"
    if out.exists():
        assert leftovers(out) == []
        dataset_ids_ok = [n for n in os.listdir(out) if n.startswith("part-")]
        assert len(dataset_ids_ok) == len(commits(out))


@pytest.mark.parametrize("seed", range(4))
def test_signal_at_random_moments_then_rerun(make_job, tmp_path, seed):
    rng = random.Random(100 + seed)
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    sig = rng.choice([signal.SIGTERM, signal.SIGINT])
    proc = fork_cli(["run", job, "--no-progress"], env={"FAKE_ENGINE_SLEEP": "0.01"})
    wait_for(lambda: handlers_installed(proc.pid) or not proc.is_alive())
    time.sleep(rng.uniform(0.0, 0.5))
    os.kill(proc.pid, sig)
    proc.join(60)
    assert proc.exitcode in (ExitCode.INTERRUPTED, 0)
    if out.exists():
        assert leftovers(out) == []
        assert len([n for n in os.listdir(out) if n.startswith("part-")]) == len(commits(out))
        dataset_ids(out)
    run(job)
    assert_every_id_once(out)


# ---- disk full, read-only ----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["part", "marker"])
def test_injected_enospc_is_one_line_exit_7_and_no_temp_file(make_job, tmp_path, monkeypatch, where):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    calls = [0]
    if where == "part":
        orig = commit_mod.pq.write_table

        def failing(table, f, **kw):
            calls[0] += 1
            if calls[0] == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
            return orig(table, f, **kw)
        monkeypatch.setattr(commit_mod.pq, "write_table", failing)
    else:
        orig = commit_mod.json.dump

        def failing(obj, f, **kw):
            if "sha256" in obj:
                calls[0] += 1
                if calls[0] == 3:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f.name)
            return orig(obj, f, **kw)
        monkeypatch.setattr(commit_mod.json, "dump", failing)
    with pytest.raises(OutputIOError, match="No space left on device. free some space"):
        run(job)
    assert leftovers(out) == [] and len(commits(out)) == 2
    calls[0] = 0
    proc = fork_cli(["run", job, "--no-progress"])  # the forked child inherits the failing disk
    proc.join(60)
    assert proc.exitcode == ExitCode.OUTPUT_IO and leftovers(out) == []
    monkeypatch.undo()
    run(job)
    assert_every_id_once(out)


def _mount(*args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.mark.slow
def test_real_full_disk(make_job, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)):
        pytest.skip("cannot mount a small tmpfs here (the injected-ENOSPC test covers the logic)")
    try:
        job = make_job(demo_rows(N_ROWS), output={"path": str(mnt / "out")})
        filler = mnt / "filler"
        with open(filler, "wb") as f:  # leave room for the metadata and a unit or two
            try:
                f.write(b"\0" * (2 * 1024 * 1024 - 48 * 1024))
            except OSError:
                pass
        r = run_cli("run", job, "--no-progress")
        assert r.returncode == ExitCode.OUTPUT_IO, r.stderr
        one_error_line(r.stderr, "No space left on device")
        assert leftovers(mnt / "out") == []
        os.remove(filler)
        assert run_cli("run", job, "--no-progress").returncode == 0
        assert_every_id_once(mnt / "out")
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # lazy: never leaves a mount behind


def test_status_show_verify_on_a_read_only_output_dir(make_job, tmp_path):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run(job)
    if os.geteuid() != 0 or not _mount("--bind", str(out), str(out)):
        pytest.skip("cannot bind-mount here")
    try:
        if not _mount("-o", "remount,bind,ro", str(out)):
            pytest.skip("cannot remount read-only here")
        for cmd in (["status", out], ["show", out, "--limit", "2"], ["verify", out]):
            r = run_cli(*cmd)
            assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        r = run_cli("run", job, "--no-progress", "--restart")
        assert r.returncode in (ExitCode.CONFIG, ExitCode.OUTPUT_IO)
        one_error_line(r.stderr, str(out))
    finally:
        subprocess.run(["umount", "-l", str(out)], capture_output=True)
    assert_every_id_once(out)


# ---- damaged metadata --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("what", ["manifest_garbage", "manifest_not_mapping", "plan_garbage"])
def test_damaged_metadata_is_one_line_and_restart_recovers(make_job, tmp_path, what):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    run(job)
    target = out / "_batchrun" / ("plan/plan.json" if what == "plan_garbage" else "manifest.json")
    target.write_text("[1, 2" if what != "manifest_not_mapping" else "[1, 2]")
    for cmd in (["status", out], ["show", out], ["verify", out]):
        r = run_cli(*cmd)
        assert r.returncode == ExitCode.CONFIG
        one_error_line(r.stderr, "damaged")
    if what != "plan_garbage":  # a damaged plan is replanned under the intact manifest
        r = run_cli("run", job, "--no-progress")
        assert r.returncode == ExitCode.CONFIG
        one_error_line(r.stderr, "rerun with --restart")
        assert run_cli("run", job, "--no-progress", "--restart").returncode == 0
    else:
        assert run_cli("run", job, "--no-progress").returncode == 0
    assert_every_id_once(out)


# ---- bad numbers -------------------------------------------------------------------------------

def test_bad_cli_numbers_are_usage_errors(make_job):
    job = make_job(demo_rows(6))
    for args in (["plan", job, "--num-tasks", "-3"], ["plan", job, "--num-tasks", "0"],
                 ["run", job, "--num-tasks", "0"], ["run", job, "--task-id", "-1"],
                 ["show", "out", "--limit", "-1"], ["slurm", job, "--array", "0"]):
        r = run_cli(*args)
        assert r.returncode == ExitCode.USAGE and "Traceback" not in r.stderr, (args, r.stderr)


def test_max_model_len_above_the_model_is_refused_before_allocation(make_job):
    job = make_job(demo_rows(6), engine={"max_model_len": 100000000})
    for cmd in ("plan", "run"):
        r = run_cli(cmd, job, *(["--no-progress"] if cmd == "run" else []), fake=False)
        assert r.returncode == ExitCode.CONFIG
        one_error_line(r.stderr, "engine.max_model_len: 100000000 is longer than the model's context")


def test_plan_checks_that_the_output_is_writable(make_job, tmp_path):
    (tmp_path / "afile").write_text("a file")
    r = run_cli("plan", make_job(demo_rows(6), output={"path": "afile/out"}))
    assert r.returncode == ExitCode.CONFIG
    one_error_line(r.stderr, "output.path: cannot write to")
