"""The streaming runner under kill -9 and SIGTERM: the feeder reads ahead on its thread, the
writer commits on its own, behind the engine (a slow write_part). A rerun still leaves every id
exactly once, and a signal leaves only committed units."""
import json
import multiprocessing
import os
import signal
import time

import pytest

from batchrun.job.exit_codes import ExitCode
from batchrun.job.jobfile.spec import load_job
from batchrun.job.run.runner import run_job
from tests.helpers.faults import assert_every_id_once, commits, dataset_ids, N_ROWS, wait_for
from tests.helpers.jobs import demo_rows
from tests.helpers.fake_engine import FakeEngine

WRITE_DELAY_S = 0.25


def _child(args, crash_at, kill_after, state_path, env):
    """Forked child: the CLI with the streaming fake engine and a slow writer."""
    os.environ.update({"TOKENIZERS_PARALLELISM": "false", **env})
    import batchrun.job.store.commit as commit
    import batchrun.job.run.runner as runner
    from tests.helpers import fake_cli
    fake_cli.install(crash_at)  # also patches publish/record for crash_at points
    runner.load_engine = FakeEngine.from_spec
    made = {}

    class Feeder(runner.Feeder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made["feeder"] = self

    class Writer(runner.Writer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made["writer"] = self
    runner.Feeder, runner.Writer = Feeder, Writer
    orig_write = commit.write_part

    def slow_write(*a, **kw):
        time.sleep(WRITE_DELAY_S)
        return orig_write(*a, **kw)
    commit.write_part = slow_write

    def record():
        w, f = made["writer"], made["feeder"]
        with open(state_path, "w") as fh:
            json.dump({"built": f.units_built, "committed": w.units_written, "backlog": w.backlog}, fh)
    FakeEngine.emitted, FakeEngine.kill_after = 0, kill_after
    FakeEngine.before_kill = staticmethod(record)
    from batchrun.__main__ import entry
    entry(args)


def start(job, crash_at="", kill_after=0, state=None, env=None):
    proc = multiprocessing.get_context("fork").Process(
        target=_child, args=([str(a) for a in ("run", job, "--no-progress")], crash_at, kill_after,
                             str(state), env or {}))
    proc.start()
    return proc


def rerun(job):
    return run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None)


@pytest.mark.parametrize("kill_after", [5, 14, 23])
def test_kill_while_feeder_ahead_and_writer_behind_then_rerun(make_job, tmp_path, kill_after):
    # max_num_seqs 32: the feeder may read 64 rows ahead, i.e. the whole job (the fake engine runs 3)
    job = make_job(demo_rows(N_ROWS), engine={"max_num_seqs": 32})
    out, state = tmp_path / "out", tmp_path / "state.json"
    # 20 ms per result: the feeder (real tokenizer) gets ahead even on a loaded machine
    proc = start(job, kill_after=kill_after, state=state, env={"FAKE_ENGINE_SLEEP": "0.02"})
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    s = json.loads(state.read_text())
    finished_units = s["committed"] + s["backlog"]
    assert s["built"] > finished_units, s  # the feeder was ahead of the engine
    assert s["backlog"] >= 1, s  # finished units were still waiting for the writer
    assert len(commits(out)) <= s["committed"] + 1  # at most the one being written finished since
    dataset_ids(out)  # whole part files only, no duplicates
    stats = rerun(job)
    assert stats.units_skipped == len(commits(out)) - stats.units_done
    assert_every_id_once(out)
    assert len(commits(out)) == 9


@pytest.mark.parametrize("crash_at", ["before_rename:2", "after_rename:3", "after_commit:4"])
def test_kill_inside_the_writer_thread_then_rerun(make_job, tmp_path, crash_at):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    proc = start(job, crash_at=crash_at, state=tmp_path / "state.json")
    proc.join(60)
    assert proc.exitcode == 137
    assert len(commits(out)) == int(crash_at.split(":")[1]) - (0 if crash_at.startswith("after_commit") else 1)
    dataset_ids(out)
    rerun(job)
    assert_every_id_once(out)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_writer_behind_leaves_only_committed_units(make_job, tmp_path, sig):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    proc = start(job, state=tmp_path / "state.json", env={"FAKE_ENGINE_SLEEP": "0.03"})
    wait_for(lambda: len(commits(out)) >= 1)
    os.kill(proc.pid, sig)
    proc.join(60)
    assert proc.exitcode == ExitCode.INTERRUPTED
    ids = dataset_ids(out)
    markers = [json.loads((out / "_batchrun" / "commits" / c).read_text()) for c in commits(out)]
    assert len(ids) == sum(m["rows"] for m in markers)  # every visible part is committed
    assert 1 <= len(markers) < 9
    assert os.listdir(out / "_batchrun" / "tmp") == []  # the writer finished before the cleanup
    rerun(job)
    assert_every_id_once(out)
