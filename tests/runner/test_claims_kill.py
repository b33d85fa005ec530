"""Three local workers share one output directory through unit claims (#14); one is killed with
SIGKILL at a random moment of its work; the other two take over its expired claims and finish: every id once."""
import json
import os
import random
import shutil
import signal
import time

import pytest

from tests.helpers.faults import assert_every_id_once, commits, N_ROWS
from tests.helpers.jobs import demo_rows, fork_cli

LEASE = "0.4"  # a killed worker's claims expire after 0.4 s
ROUNDS = 10


@pytest.mark.slow
def test_kill_one_of_three_workers_the_others_finish_every_id_once(make_job, tmp_path):
    job = make_job(demo_rows(N_ROWS))
    out = tmp_path / "out"
    rng = random.Random(int(os.environ.get("CLAIMS_KILL_SEED", "14")))
    taken_over = 0
    for round_ in range(ROUNDS):
        shutil.rmtree(out, ignore_errors=True)
        env = {"FAKE_ENGINE_SLEEP": "0.03", "BATCHRUN_CLAIM_LEASE": LEASE}
        procs = [fork_cli(["run", job, "--no-progress", "--task-id", t, "--num-tasks", 3], env=env)
                 for t in range(3)]
        # start-up (imports, the plan) takes ~0.5 s: the victim is a worker holding a claim then
        victim, delay = int(rng.choice(_claimants(out))), rng.uniform(0.05, 0.3)
        time.sleep(delay)  # then a random moment of its work
        os.kill(procs[victim].pid, signal.SIGKILL)
        for p in procs:
            p.join(60)
        where = f"round {round_}: killed task {victim} after {delay:.3f}s"
        assert procs[victim].exitcode == -signal.SIGKILL, where
        assert [p.exitcode for i, p in enumerate(procs) if i != victim] == [0, 0], where
        assert len(commits(out)) == 9, where
        assert_every_id_once(out)
        tasks = json.loads((out / "_batchrun" / "metrics.json").read_text())["tasks"]
        taken_over += sum(t["units_taken_over"] for name, t in tasks.items() if name != f"task-{victim}")
    assert taken_over > 0  # the survivors did take over the victim's expired claims


def _claimants(out, timeout: float = 30.0) -> list[str]:
    """The workers named by claim files, as soon as there is one (a worker killed before its
    first claim leaves nothing to take over, and the round would test nothing)."""
    claims = out / "_batchrun" / "claims"
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = set()
        for name in os.listdir(claims) if claims.is_dir() else []:
            try:
                found.add(json.loads((claims / name).read_text())["worker"])
            except (OSError, ValueError, KeyError):
                continue  # released meanwhile, or being written
        if found:
            return sorted(found)
        time.sleep(0.005)
    raise AssertionError(f"no worker claimed a unit within {timeout} s")


@pytest.mark.parametrize("workers", [2])
def test_a_worker_waits_for_a_live_claim_then_exits_when_it_commits(make_job, tmp_path, workers):
    job = make_job(demo_rows(12))  # 3 units
    out = tmp_path / "out"
    env = {"FAKE_ENGINE_SLEEP": "0.05", "BATCHRUN_CLAIM_LEASE": "5"}
    procs = [fork_cli(["run", job, "--no-progress", "--task-id", t, "--num-tasks", workers], env=env)
             for t in range(workers)]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * workers
    assert_every_id_once(out, 12)
