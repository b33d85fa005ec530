"""A resumed run's progress counts the whole job, with the units committed earlier already done."""
import re

import pytest
from click.testing import CliRunner

import batchrun.job.run.runner as runner_mod
from batchrun.cli import ExitCode, main
from batchrun.job.run.progress_bar import Progress
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows


@pytest.fixture(autouse=True)
def fake_engine(monkeypatch):
    monkeypatch.setattr(runner_mod, "load_engine", FakeEngine.from_spec)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_resumed_log_lines_start_at_the_committed_share(make_job):
    rows = demo_rows(12)
    rows[4]["prompt"] = None
    assert cli("run", make_job(rows, on_error="fail"), "--no-progress").exit_code == ExitCode.ROW_ERROR  # unit 0
    r = cli("run", make_job(rows), "--progress", "log", "--log-interval", "0", "--verbose")
    assert r.exit_code == 0, r.output
    counts = [tuple(map(int, m.groups())) for m in re.finditer(r": rows (\d+)/(\d+) \(", r.output)]
    assert counts, r.output
    assert all(total == 12 for _, total in counts)
    assert counts[0][0] > 4 and counts[-1][0] == 12  # the 4 committed rows count as done
    units = [tuple(map(int, m.groups())) for m in re.finditer(r"; (\d+)/(\d+) units\n", r.output)]
    assert units[0] == (2, 3) and units[-1] == (3, 3)


def test_bar_starts_at_the_committed_rows():
    logged = []
    p = Progress("bar", "task 0/1", total_rows=100, total_units=10, log=logged.append, done_rows=45, done_units=4)
    try:
        assert p.bar.n == 45 and p.bar.total == 100
        p.row(3, False)
        assert p.bar.n == 46
    finally:
        p.close()
