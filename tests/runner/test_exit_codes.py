"""Exit codes a script acts on: verify/status while units are pending (9), max_error_rate (10),
the interrupt summary and message."""
import signal

import pytest
from click.testing import CliRunner

import batchrun.job.run.runner as runner_mod
from batchrun.cli import ExitCode, main
from batchrun.job.run.interrupt import Interrupted
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, read_output


@pytest.fixture(autouse=True)
def fake_engine(monkeypatch):
    monkeypatch.setattr(runner_mod, "load_engine", FakeEngine.from_spec)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def half_finished(make_job, tmp_path):
    """An output with unit 0 committed and units 1-2 pending (on_error: fail stopped at row 4)."""
    rows = demo_rows(12)
    rows[4]["prompt"] = None
    assert cli("run", make_job(rows, on_error="fail"), "--no-progress").exit_code == ExitCode.ROW_ERROR
    return rows, tmp_path / "out"


def test_verify_and_status_exit_9_while_units_are_pending(make_job, tmp_path):
    rows, out = half_finished(make_job, tmp_path)
    r = cli("verify", out)
    assert r.exit_code == ExitCode.PENDING == 9, r.output
    lines = r.output.splitlines()
    assert "ok" not in lines and lines[-1] == "INCOMPLETE"
    assert "pending:  2 of 3 unit(s) not committed yet" in r.output
    r = cli("status", out)
    assert r.exit_code == ExitCode.PENDING and "incomplete" in r.output
    assert cli("run", make_job(rows), "--no-progress").exit_code == 0  # on_error: skip finishes it
    r = cli("verify", out)
    assert r.exit_code == 0 and r.output.splitlines()[-1] == "ok"
    assert cli("status", out).exit_code == 0


def test_status_exits_8_for_a_damaged_part(make_job, tmp_path):
    assert cli("run", make_job(demo_rows(8)), "--no-progress").exit_code == 0
    (tmp_path / "out" / "part-000001.parquet").unlink()
    r = cli("status", tmp_path / "out")
    assert r.exit_code == ExitCode.DAMAGED and "damaged: 1 committed unit(s)" in r.output
    assert cli("verify", tmp_path / "out").exit_code == ExitCode.DAMAGED


def bad_rows(n_rows=12, bad=(1, 5, 9)):
    rows = demo_rows(n_rows)
    for i in bad:
        rows[i]["prompt"] = "   "  # an error row, whatever the adapter
    return rows


def test_max_error_rate_flag_exits_10_and_keeps_the_output(make_job, tmp_path):
    job = make_job(bad_rows())  # 3 of 12 rows are error rows: 25 %
    r = cli("run", job, "--no-progress", "--max-error-rate", "0.2")
    assert r.exit_code == ExitCode.ERROR_RATE == 10, r.output
    assert "batchrun: error: 3 of 12 output rows are error rows (25.00 %), more than max_error_rate 0.2" in r.output
    assert "batchrun: summary task 0/1: exit 10" in r.output
    assert read_output(tmp_path / "out").num_rows == 12  # committed units are kept
    assert cli("verify", tmp_path / "out").exit_code == 0  # the output itself is whole
    # counted over the whole output: a resume with nothing left to do judges it again ...
    r = cli("run", job, "--no-progress", "--max-error-rate", "0.2")
    assert r.exit_code == ExitCode.ERROR_RATE and "3 already done" in r.output
    # ... and exactly R passes (failed means more than R)
    assert cli("run", job, "--no-progress", "--max-error-rate", "0.25").exit_code == 0


def test_max_error_rate_counts_rows_of_earlier_runs(make_job, tmp_path, monkeypatch):
    rows = bad_rows(12, bad=(0, 1, 2))  # all in unit 0
    for r in rows:
        r["adapter"] = None
    job = make_job(rows)
    monkeypatch.setattr(FakeEngine, "results_emitted", 0)
    monkeypatch.setattr(InterruptingEngine, "AFTER", 3)  # after unit 0 (3 error rows) is committed
    monkeypatch.setattr(runner_mod, "load_engine", InterruptingEngine.from_spec)
    assert cli("run", job, "--no-progress").exit_code == ExitCode.INTERRUPTED
    monkeypatch.setattr(runner_mod, "load_engine", FakeEngine.from_spec)
    r = cli("run", job, "--no-progress", "--max-error-rate", "0.2")
    # this run's units hold no error row; the whole output 3 of 12 (25 %)
    assert "1 already done; 8 rows (0 error rows)" in r.output, r.output
    assert r.exit_code == ExitCode.ERROR_RATE and "3 of 12 output rows are error rows" in r.output


def test_job_file_max_error_rate_and_its_checks(make_job, tmp_path):
    assert cli("run", make_job(bad_rows(), max_error_rate=0.1), "--no-progress").exit_code == ExitCode.ERROR_RATE
    # the flag overrides the job file
    assert cli("run", make_job(bad_rows(), max_error_rate=0.1), "--no-progress",
               "--max-error-rate", "0.5").exit_code == 0
    for bad in (1.5, -0.1, "half", True):
        r = cli("plan", make_job(bad_rows(), max_error_rate=bad))
        assert r.exit_code == ExitCode.CONFIG and "max_error_rate: expected a fraction of rows from 0 to 1" in r.output
    r = cli("run", make_job(bad_rows()), "--max-error-rate", "2")
    assert r.exit_code == ExitCode.USAGE


def test_a_job_whose_rows_all_fail_exits_10_by_default(make_job, tmp_path):
    rows = demo_rows(8)
    for r in rows:
        r["adapter"] = "missing"  # not under adapters: every row is an error row
    job = make_job(rows)
    r = cli("run", job, "--no-progress")
    assert r.exit_code == ExitCode.ERROR_RATE, r.output
    assert "every row of the job is an error row (8 of 8)" in r.output
    assert read_output(tmp_path / "out").num_rows == 8
    # some rows fine: not a failure by default
    ok = make_job(bad_rows(8, bad=(0, 1, 2, 3, 4, 5, 6)), output={"path": "out2"})
    assert cli("run", ok, "--no-progress").exit_code == 0
    # max_error_rate: 1 accepts a job of error rows
    assert cli("run", make_job(rows, max_error_rate=1), "--no-progress").exit_code == 0


class InterruptingEngine(FakeEngine):
    """SIGTERM's Interrupted after ``AFTER`` results: mid-unit, so some finished rows are discarded."""
    AFTER = 6

    def generate(self, requests, on_result=None):
        def counted(res):
            if FakeEngine.results_emitted >= self.AFTER:
                raise Interrupted(signal.SIGTERM)
            on_result(res)
        return super().generate(requests, counted)


def test_interrupt_summary_counts_committed_rows_and_names_the_signal(make_job, tmp_path, monkeypatch):
    monkeypatch.setattr(FakeEngine, "results_emitted", 0)
    monkeypatch.setattr(runner_mod, "load_engine", InterruptingEngine.from_spec)
    rows = demo_rows(12)
    for r in rows:
        r["adapter"] = None  # one shard, one engine call: the interrupt lands inside unit 1
    r = cli("run", make_job(rows), "--no-progress")
    assert r.exit_code == ExitCode.INTERRUPTED, r.output
    committed = read_output(tmp_path / "out").num_rows
    assert committed == 4
    assert "batchrun: summary task 0/1: exit 130 (interrupted by SIGTERM)" in r.output
    assert f"batchrun: summary rows {committed} (0 error rows); units 1 written" in r.output, r.output
    assert "finished output row(s) discarded with their uncommitted units" in r.output
    assert "batchrun: error: interrupted (SIGTERM); no partial file was left" in r.output
    assert "Interrupted)" not in r.output
