"""batchrun against a real single-node Slurm (scripts/slurm-ci.sh start; .ci/run does it in CI).

Skipped with a message where no Slurm answers, except in CI (CI=true), where that fails.
The demo model on the CPU engine (so no GPU request: the job says device: cpu), 48 rows (12 units),
small --mem/--cpus.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.s3.conftest import s3, s3_server  # noqa: F401 - fixtures: the local S3 test server

REPO = Path(__file__).resolve().parents[2]
ROWS = 48


def _slurm_up() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    if r.returncode != 0 or "idle" not in r.stdout and "mix" not in r.stdout:
        return f"no idle Slurm node (sinfo: {r.stdout.strip() or r.stderr.strip()})"
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm():
    why = _slurm_up()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but Slurm is not running: {why} (.ci/run starts it with scripts/slurm-ci.sh)")
        pytest.skip(f"no Slurm here ({why}); start one with `scripts/slurm-ci.sh install && "
                    "scripts/slurm-ci.sh start` and `eval $(scripts/slurm-ci.sh env)`")


def make_job(tmp_path: Path, rows: int = ROWS, **over) -> Path:
    demo = pq.read_table(REPO / "demo" / "data" / "prompts.parquet").to_pylist()
    rows = [{**demo[i % len(demo)], "id": f"r{i:03d}"} for i in range(rows)]
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / "in.parquet")
    job = yaml.safe_load((REPO / "jobs" / "demo.yaml").read_text())
    job["model"] = str(REPO / "demo" / "model")
    job["adapters"] = {k: str(REPO / "demo" / "adapters" / k) for k in job["adapters"]}
    job["input"]["path"] = "data/in.parquet"
    job["input"]["id_column"] = "id"
    job["output"]["path"] = "out"
    job["engine"]["device"] = "cpu"
    for section, values in over.items():
        job[section].update(values)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def submit(job: Path, array: int, script: str, *extra, time_limit: str = "00:10:00") -> str:
    r = subprocess.run([sys.executable, "-m", "batchrun", "slurm", str(job), "--array", str(array),
                        "--cpus", "1", "--mem", "1G", "--time", time_limit,
                        "--script", str(job.parent / script), "--submit", *extra],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(REPO), "BATCHRUN_CLAIM_LEASE": "3",
                            "OMP_NUM_THREADS": "1"})  # --cpus 1: torch's spinning threads would fight
    assert r.returncode == 0, r.stderr
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("Submitted batch job")]
    assert line, r.stdout
    return line[0].split()[-1]


def wait_gone(job_ids, timeout=150.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i"], capture_output=True, text=True)
        if r.returncode == 0 and not r.stdout.strip():
            return
        time.sleep(0.5)
    raise AssertionError(f"Slurm jobs {job_ids} still queued/running after {timeout}s")


def every_id_once(out: Path, rows: int = ROWS) -> None:
    import pyarrow.dataset as ds
    parts = sorted(str(p) for p in out.glob("part-*.parquet"))
    ids = ds.dataset(parts, format="parquet").to_table(columns=["id"]).column("id").to_pylist()
    assert sorted(ids) == [f"r{i:03d}" for i in range(rows)], (len(ids), len(set(ids)))
    r = subprocess.run([sys.executable, "-m", "batchrun", "verify", str(out)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr


def logs(out: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((out / "_batchrun" / "slurm").glob("*.out")))


def test_array_of_4_submitted_finishes_every_id_once(tmp_path):
    job = make_job(tmp_path)
    jid = submit(job, 4, "a.sbatch")
    wait_gone([jid])
    out = tmp_path / "out"
    every_id_once(out)
    assert logs(out).count("batchrun: summary task") == 4, logs(out)[-3000:]
    assert os.listdir(out / "_batchrun" / "claims") == []


def test_output_under_a_variable_unset_when_written_is_expanded_on_the_node(tmp_path):
    job = make_job(tmp_path, output={"path": "$BATCHRUN_CI_SCRATCH/out"})
    env = {k: v for k, v in os.environ.items() if k != "BATCHRUN_CI_SCRATCH"}
    r = subprocess.run([sys.executable, "-m", "batchrun", "slurm", str(job), "--array", "2", "--cpus", "1",
                        "--mem", "1G", "--time", "00:10:00"], capture_output=True, text=True, timeout=60,
                       env={**env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and "$BATCHRUN_CI_SCRATCH" in r.stdout, r.stdout + r.stderr
    scratch = tmp_path / "scratch"
    r = subprocess.run(["sbatch", str(tmp_path / "job.sbatch")], capture_output=True, text=True, check=True,
                       env={**env, "PYTHONPATH": str(REPO), "BATCHRUN_CI_SCRATCH": str(scratch),
                            "BATCHRUN_CLAIM_LEASE": "3", "OMP_NUM_THREADS": "1"})
    jid = r.stdout.split()[-1]
    wait_gone([jid])
    out = scratch / "out"
    every_id_once(out)
    assert logs(out).count("batchrun: summary task") == 2, logs(out)[-3000:]
    assert sorted(p.name for p in (out / "_batchrun" / "slurm").glob("*.out")) == [f"{jid}_0.out", f"{jid}_1.out"]
    assert sorted(p.name for p in tmp_path.glob("job-*.out")) == [f"job-{jid}_0.out", f"job-{jid}_1.out"]


def test_a_second_array_of_another_size_joins_a_running_one(tmp_path):
    job = make_job(tmp_path)
    a = submit(job, 2, "a.sbatch")
    b = submit(job, 3, "b.sbatch")  # other --array count, same output dir, at the same time
    wait_gone([a, b])
    out = tmp_path / "out"
    every_id_once(out)
    text = logs(out)
    assert text.count("exit 0 (done)") == 5, text[-3000:]
    markers = [json.loads(p.read_text()) for p in (out / "_batchrun" / "commits").glob("unit-*.json")]
    assert len(markers) == ROWS // 4


def test_scancel_one_task_mid_run_the_others_finish_its_units(tmp_path):
    job = make_job(tmp_path)
    jid = submit(job, 3, "a.sbatch")
    out = tmp_path / "out"
    deadline = time.time() + 120
    while time.time() < deadline:  # cancel task 0 once it holds a claim
        claims = [json.loads(p.read_text() or "{}") for p in (out / "_batchrun" / "claims").glob("unit-*")] \
            if (out / "_batchrun" / "claims").is_dir() else []
        if any(c.get("worker", "").startswith("0-") for c in claims) or (out / "_batchrun" / "commits").is_dir() \
                and len(list((out / "_batchrun" / "commits").glob("unit-*"))) >= 2:
            break
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=KILL", f"{jid}_0"], check=True)
    wait_gone([jid])
    every_id_once(out)


def test_restart_script_resubmitted_resumes_instead_of_wiping(tmp_path):
    job = make_job(tmp_path)
    wait_gone([submit(job, 2, "r.sbatch", "--restart")])
    out = tmp_path / "out"
    every_id_once(out)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    r = subprocess.run(["sbatch", str(tmp_path / "r.sbatch")], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    wait_gone([r.stdout.split()[-1]])
    every_id_once(out)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")} == before  # nothing rewritten
    assert "nothing to do: all 12 of its units were committed by an earlier run" in logs(out)


def test_sigterm_from_slurm_exits_130_and_a_resubmission_resumes(tmp_path):
    # What the script's `--signal=B:TERM@120` does at the time limit, delivered now with scancel:
    # SIGTERM to the batch shell, which exec'd batchrun.
    job = make_job(tmp_path)
    jid = submit(job, 1, "t.sbatch")
    out = tmp_path / "out"
    deadline = time.time() + 120
    while time.time() < deadline and not list((out / "_batchrun" / "commits").glob("unit-*")):
        time.sleep(0.05)  # (glob of a missing directory is empty)
    subprocess.run(["scancel", "--batch", "--signal=TERM", jid], check=True)
    wait_gone([jid])
    text = logs(out)
    committed = len(list((out / "_batchrun" / "commits").glob("unit-*")))
    if committed < ROWS // 4:  # stopped mid-run (not already done)
        assert "exit 130" in text, text[-3000:]
    r = subprocess.run(["sbatch", str(tmp_path / "t.sbatch")], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONPATH": str(REPO), "BATCHRUN_CLAIM_LEASE": "3"})
    wait_gone([r.stdout.split()[-1]])
    every_id_once(out)
    assert f"({committed} already committed)" in logs(out) or committed == ROWS // 4


def exit_code(job_id: str) -> int:
    """The finished job's exit status as slurmctld recorded it (kept for MinJobAge; no sacct needed)."""
    r = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True)
    m = re.search(r"\bExitCode=(\d+):(\d+)", r.stdout)
    assert m, r.stdout
    return int(m.group(1))


def test_time_limit_signal_exits_130_and_a_resubmission_resumes(tmp_path):
    # The real thing: `--time 1` (Slurm's smallest limit) with `--signal-before 25`, so Slurm itself
    # sends SIGTERM (it checks limits every 30 s and may signal that much early: 5-35 s in). So that
    # the task is certainly still running then, however fast the machine, another "worker" (this
    # test) planned the output dir and holds live claims on its last units: the task runs the
    # others, then waits for those. (On a slow machine the signal may come during start-up; every
    # check below holds either way.)
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.plan.prepare import prepare
    rows = ROWS
    job = make_job(tmp_path, rows, sampling={"ignore_eos": True})
    out = tmp_path / "out"
    total = len(prepare(load_job(str(job))).plan.units)
    held = {f"unit-{u:06d}" for u in range(total - 4, total)}
    claims = out / "_batchrun" / "claims"
    claims.mkdir()
    for name in held:  # live for an hour, whatever the task's own lease
        (claims / name).write_text(json.dumps(
            {"host": "test", "pid": 1, "worker": "other", "token": "0" * 16, "lease_s": 3600, "claimed": time.time()}))
    jid = submit(job, 1, "t.sbatch", "--signal-before", "25", time_limit="1")
    assert "#SBATCH --signal=B:TERM@25\n" in (tmp_path / "t.sbatch").read_text()
    wait_gone([jid], timeout=120)
    assert exit_code(jid) == 130, logs(out)[-3000:]
    text = logs(out)
    assert "interrupted (SIGTERM); no partial file was left" in text, text[-3000:]
    assert set(os.listdir(claims)) == held  # its own claims given back, the other worker's left alone
    committed = len(list((out / "_batchrun" / "commits").glob("unit-*")))
    assert committed <= total - len(held)
    old = time.time() - 7200  # the other worker died: its claims expire, the resubmission takes them
    for name in held:
        os.utime(claims / name, (old, old))
    r = subprocess.run(["sbatch", "--time=5", str(tmp_path / "t.sbatch")], capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONPATH": str(REPO), "BATCHRUN_CLAIM_LEASE": "3",
                                        "OMP_NUM_THREADS": "1"})
    again = r.stdout.split()[-1]
    wait_gone([again])
    assert exit_code(again) == 0, logs(out)[-3000:]
    every_id_once(out, rows)
    assert f"({committed} already committed)" in logs(out)
    assert os.listdir(claims) == []
    metrics = json.loads((out / "_batchrun" / "metrics" / f"task-0-j{again}.json").read_text())
    assert metrics["units_taken_over"] == len(held) and metrics["units_done"] == total - committed


def test_array_on_an_s3_output_finishes_every_id_once_with_logs_next_to_the_script(tmp_path, s3):  # noqa: F811
    """Two array tasks share an s3:// output (the local S3 test server; sbatch passes on the AWS
    variables as it would a user's): every id once, verify passes, each task logs next to the script."""
    from tests.s3.helpers import read_parts
    demo = pq.read_table(REPO / "demo" / "data" / "prompts.parquet").to_pylist()
    s3.put_rows("in/a.parquet", [{**demo[i % len(demo)], "id": f"r{i:03d}"} for i in range(ROWS)])
    job = make_job(tmp_path, input={"path": s3.uri("in/")}, output={"path": s3.uri("out")})
    jid = submit(job, 2, "s.sbatch")
    wait_gone([jid])
    ids = read_parts(s3, "out").column("id").to_pylist()
    assert sorted(ids) == [f"r{i:03d}" for i in range(ROWS)], (len(ids), len(set(ids)))
    r = subprocess.run([sys.executable, "-m", "batchrun", "verify", s3.uri("out")], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    logs_ = sorted(tmp_path.glob("job-*.out"))
    assert [p.name for p in logs_] == [f"job-{jid}_0.out", f"job-{jid}_1.out"]
    assert "".join(p.read_text() for p in logs_).count("batchrun: summary task") == 2
