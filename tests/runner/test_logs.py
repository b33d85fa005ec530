"""Logs that read well in Slurm and cron (issue 17): newline-separated progress lines off a
terminal, the summary block at the end of every task, every run kept in metrics.json, exit codes
in --help, and messages that say what an empty task or an unknown adapter means."""
import json
import os
import subprocess
import sys

import pytest

from batchrun.cli import ExitCode
from tests.helpers.jobs import demo_rows, fork_cli, HERE, REPO, run_cli


def run_logged(job, log_path, *flags, env=None):
    """The CLI (FakeEngine) with stderr going to a file, as under Slurm (`--output=...`)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    with open(log_path, "w") as err:
        return subprocess.run([sys.executable, str(HERE / "fake_cli.py"), "run", str(job), *flags],
                              stdout=subprocess.DEVNULL, stderr=err, env=full_env, timeout=120).returncode


@pytest.mark.slow
def test_log_mode_off_a_terminal_is_line_based_and_ends_with_the_summary(make_job, tmp_path):
    rows = demo_rows(30)
    rows[4]["prompt"] = ""
    rows[7]["prompt"] = None
    job = make_job(rows)
    log = tmp_path / "task.log"
    code = run_logged(job, log, "--log-interval", "0.05", "--verbose", env={"FAKE_ENGINE_SLEEP": "0.01"})
    assert code == 0
    text = log.read_text()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    progress = [ln for ln in lines if ": rows " in ln and "ETA" in ln]
    assert len(progress) >= 2, text  # auto = log off a terminal, one line per 0.05 s interval
    assert "(graphs: lora)" in text and "(graphs: base)" in text
    assert sum("committed unit" in ln for ln in lines) == 9  # --verbose: one per unit
    summary = [ln for ln in lines if ln.startswith("batchrun: summary")]
    assert lines[-len(summary):] == summary, "the summary block ends the log"
    assert summary[0] == "batchrun: summary task 0/1: exit 0 (done)"
    assert any("rows 30 (2 error rows); units 9 written, 0 already done" in ln for ln in summary)
    assert any("error rows 1x: prompt is empty (column 'prompt')" in ln for ln in summary)
    assert any("error rows 1x: prompt is null (column 'prompt')" in ln for ln in summary)
    assert any("start-up" in ln and "generation" in ln and "writing" in ln for ln in summary)


@pytest.mark.slow
def test_failed_task_still_ends_with_a_summary_giving_its_exit_code(make_job, tmp_path):
    rows = demo_rows(12)
    rows[9]["prompt"] = None
    log = tmp_path / "task.log"
    assert run_logged(make_job(rows, on_error="fail"), log, "--progress", "log") == ExitCode.ROW_ERROR
    summary = [ln for ln in log.read_text().splitlines() if ln.startswith("batchrun: summary")]
    assert summary and summary[0].startswith("batchrun: summary task 0/1: exit 4 (failed")


def test_metrics_keep_every_run_of_every_task(make_job, tmp_path):
    job = make_job(demo_rows(30))
    out = tmp_path / "out"
    for task in (0, 1, 0, 0):
        proc = fork_cli(["run", job, "--no-progress", "--task-id", task, "--num-tasks", 2])
        proc.join(60)
        assert proc.exitcode == 0
    metrics = json.loads((out / "_batchrun" / "metrics.json").read_text())
    assert [r["task_id"] for r in metrics["runs"]] == [0, 1, 0, 0]
    assert metrics["complete"] and metrics["units_committed"] == 9
    t0 = json.loads((out / "_batchrun" / "metrics" / "task-0.json").read_text())
    assert len(t0["runs"]) == 3 and t0["runs"][0]["units_done"] > 0 and t0["runs"][1]["units_done"] == 0


@pytest.mark.slow
def test_help_lists_exit_codes_and_empty_tasks_say_why(make_job, tmp_path):
    r = run_cli("run", "--help")
    assert r.returncode == 0
    for code in ("0 done", "3 bad job file", "5 output dir holds a different job", "7 output dir or object store not",
                 "130 interrupted"):
        assert code in " ".join(r.stdout.split()), r.stdout
    job = make_job(demo_rows(6))
    # 3 units: the --num-tasks hint gives task 1 no share, but units are claimed dynamically (#14), so
    # a worker alone runs every unclaimed unit
    r = run_cli("run", job, "--no-progress", "--task-id", 1, "--num-tasks", 4)
    assert r.returncode == 0
    assert "task 1/4: 3 unit(s) written" in r.stderr
    r = run_cli("run", job, "--no-progress")
    assert "nothing to do: all 3 of its units were committed by an earlier run" in r.stderr


@pytest.mark.slow
def test_show_says_an_adapter_is_unknown(make_job, tmp_path):
    rows = demo_rows(3)
    rows[1]["adapter"] = "nope"
    job = make_job(rows)
    assert run_cli("run", job, "--no-progress").returncode == 0
    r = run_cli("show", tmp_path / "out", "--limit", "3")
    assert "[nope (unknown adapter: not under adapters:, so the row was not run)] id=1" in r.stdout
