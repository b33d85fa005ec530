"""jobs/cron.example's entry, run by bash as cron runs it, with a stand-in `batchrun` whose exit
codes the test chooses: the day is published only after `run` and `verify` both exit 0, the day is
stamped at run time, and a run that finds the lock taken does nothing."""
import fcntl
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CRONTAB = REPO / "jobs" / "cron.example"


def crontab():
    """(variables, command) of the example: cron's VAR=value lines and its one entry's command,
    with `\\%` unescaped as cron does."""
    variables, commands = {}, []
    for line in CRONTAB.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line)
        if m:
            variables[m.group(1)] = m.group(2)
        else:
            commands.append(line.split(None, 5)[5].replace("\\%", "%"))
    assert len(commands) == 1, commands
    return variables, commands[0]


@pytest.fixture
def site(tmp_path):
    variables, command = crontab()
    calls = tmp_path / "calls"
    fake = tmp_path / "batchrun"
    fake.write_text('#!/usr/bin/env bash\necho "$* DAY=$DAY" >> "$FAKE_CALLS"\necho "batchrun $1 says hi"\n'
                    'case $1 in run) exit "${FAKE_RUN_RC:-0}";; verify) exit "${FAKE_VERIFY_RC:-0}";; esac\n')
    fake.chmod(0o755)
    (tmp_path / "out").mkdir()
    (tmp_path / "logs").mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **variables,
           "BATCHRUN": str(fake), "NIGHTLY_JOB": str(tmp_path / "nightly.yaml"), "NIGHTLY_OUT": str(tmp_path / "out"),
           "NIGHTLY_LOCK": str(tmp_path / "nightly.lock"), "NIGHTLY_LOGS": str(tmp_path / "logs"),
           "FAKE_CALLS": str(calls)}
    day = subprocess.run(["date", "-d", "yesterday", "+%F"], capture_output=True, text=True, check=True).stdout.strip()

    def run(**rc):
        if calls.exists():
            calls.unlink()
        r = subprocess.run([variables["SHELL"], "-c", command], env={**env, **rc}, capture_output=True, text=True,
                           timeout=60)
        return r.returncode, calls.read_text().splitlines() if calls.exists() else []

    return run, tmp_path, day


def test_a_finished_and_verified_day_is_published(site):
    run, tmp, day = site
    rc, calls = run()
    assert rc == 0
    assert calls == [f"run {tmp}/nightly.yaml --progress log DAY={day}", f"verify {tmp}/out/{day} DAY={day}"]
    assert os.readlink(tmp / "out" / "latest") == day
    assert "batchrun verify says hi" in (tmp / "logs" / f"nightly-{day}.log").read_text()


@pytest.mark.parametrize("run_rc,verify_rc,verified", [("130", "0", False), ("10", "0", False), ("5", "0", False),
                                                       ("0", "9", True), ("0", "8", True)])
def test_an_unfinished_day_is_not_published(site, run_rc, verify_rc, verified):
    run, tmp, day = site
    rc, calls = run(FAKE_RUN_RC=run_rc, FAKE_VERIFY_RC=verify_rc)
    assert rc == int(verify_rc if verified else run_rc)
    assert any(c.startswith("verify ") for c in calls) == verified
    assert not (tmp / "out" / "latest").exists()


def test_a_run_that_finds_the_lock_taken_does_nothing(site):
    run, tmp, day = site
    with open(tmp / "nightly.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # yesterday's run, still going
        rc, calls = run()
    assert rc == 75 and calls == []
    assert not (tmp / "out" / "latest").exists()
