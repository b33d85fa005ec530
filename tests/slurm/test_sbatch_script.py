"""The script `batchrun slurm` writes, without a Slurm: its #SBATCH lines, and what it does when
bash runs it with the variables Slurm sets (a stand-in `batchrun` on PATH records its arguments)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from batchrun.cli import slurm_task_defaults
from batchrun.errors import ConfigError
from batchrun.job.launch import slurm as sl
from batchrun.job.jobfile.spec import _resolve

REPO = Path(__file__).resolve().parents[2]
SLURM_VARS = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_STEP",
              "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_JOB_ID")


def write_job(tmp_path: Path, output: str = "out", device: str | None = "cpu") -> Path:
    job = yaml.safe_load((REPO / "jobs" / "demo.yaml").read_text())
    job["model"] = str(REPO / "demo" / "model")
    job["adapters"] = {k: str(REPO / "demo" / "adapters" / k) for k in job["adapters"]}
    job["input"]["path"] = str(REPO / "demo" / "data" / "prompts.parquet")
    job["output"]["path"] = output
    if device is None:
        job["engine"].pop("device")
    else:
        job["engine"]["device"] = device
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def cli_slurm(job: Path, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchrun", "slurm", str(job), *args], capture_output=True,
                          text=True, timeout=120, env={**(env or os.environ), "PYTHONPATH": str(REPO)})


@pytest.fixture
def fake_batchrun(tmp_path, monkeypatch):
    """A `batchrun` first on PATH that prints its arguments and the task variables, then exits 0."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "batchrun"
    exe.write_text('#!/usr/bin/env bash\necho "args: $*"\necho "task: ${SLURM_ARRAY_TASK_ID:-} of array '
                   '${SLURM_ARRAY_JOB_ID:-}"\necho "to stderr" >&2\n')
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return exe


def run_script(script: Path, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in SLURM_VARS and k != "SCRATCH"}
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env={**base, **env})


@pytest.mark.parametrize("device,flag,gpus", [("cpu", None, None), ("auto", None, 1), (None, None, 1),
                                              ("cuda", None, 1), ("auto", 2, 2), ("cuda", 0, None)])
def test_gpu_request_follows_the_jobs_device(tmp_path, device, flag, gpus):
    job = sl.read_job(write_job(tmp_path, device=device))
    text = sl.sbatch_script(job, 4, str(tmp_path / "job.sbatch"), gpus_per_task=flag)
    assert "--gpus=" not in text  # a per-job total would not follow the array's tasks
    lines = re.findall(r"^#SBATCH --gpus-per-task=(\d+)$", text, re.M)
    assert lines == ([] if gpus is None else [str(gpus)])


def test_gpus_for_a_cpu_job_are_refused_naming_the_field(tmp_path):
    job = sl.read_job(write_job(tmp_path, device="cpu"))
    with pytest.raises(ConfigError, match="engine.device: cpu"):
        sl.sbatch_script(job, 2, str(tmp_path / "job.sbatch"), gpus_per_task=1)


def test_logs_append_and_no_task_count_is_baked_in(tmp_path, fake_batchrun):
    job = write_job(tmp_path)
    r = cli_slurm(job, "--array", "4")
    assert r.returncode == 0, r.stderr
    script = tmp_path / "job.sbatch"
    text = script.read_text()
    assert "#SBATCH --open-mode=append\n" in text
    assert f"#SBATCH --output={tmp_path / 'out' / '_batchrun' / 'slurm'}/%A_%a.out\n" in text
    assert "SLURM_ARRAY_TASK_STEP" in text.split("set -euo pipefail")[0]  # the task-id comment
    assert "--num-tasks" not in text
    assert "static" not in text and "contiguous" not in text
    for _ in range(2):  # a requeue runs the same script again
        r = run_script(script, SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="3", SLURM_ARRAY_TASK_MIN="0",
                       SLURM_ARRAY_TASK_MAX="3", SLURM_ARRAY_TASK_COUNT="4")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[0] == f"args: run {job}"  # sbatch's --output holds this


def test_output_path_variables_expand_on_the_node_not_when_written(tmp_path, fake_batchrun, monkeypatch):
    monkeypatch.delenv("SCRATCH", raising=False)
    job = write_job(tmp_path, output="$SCRATCH/runs/${USER_TAG}_x")
    env = {k: v for k, v in os.environ.items() if k not in ("SCRATCH", "USER_TAG")}
    r = cli_slurm(job, "--array", "2", env=env)  # a login node without $SCRATCH: still written
    assert r.returncode == 0, r.stderr
    assert "$SCRATCH" in r.stdout and "$USER_TAG" in r.stdout and "not set here" in r.stdout
    script = tmp_path / "job.sbatch"
    text = script.read_text()
    assert f"#SBATCH --output={tmp_path}/job-%A_%a.out\n" in text  # Slurm cannot expand variables
    assert "#SBATCH --open-mode=append\n" in text
    scratch = tmp_path / "scratch"
    for _ in range(2):
        r = run_script(script, SCRATCH=str(scratch), USER_TAG="ann", SLURM_ARRAY_JOB_ID="77",
                       SLURM_ARRAY_TASK_ID="1", SLURM_ARRAY_TASK_MIN="0", SLURM_ARRAY_TASK_COUNT="2")
        assert r.returncode == 0, r.stderr
        assert r.stdout == "" and r.stderr == ""  # all of it went to the log
    log = (scratch / "runs" / "ann_x" / "_batchrun" / "slurm" / "77_1.out").read_text()
    assert log.count(f"args: run {job}\n") == 2 and log.count("to stderr\n") == 2  # appended
    assert "task: 1 of array 77" in log
    r = run_script(script, USER_TAG="ann", SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="1")
    assert r.returncode != 0 and "SCRATCH" in r.stderr and "args:" not in r.stdout  # unset on the node


@pytest.mark.parametrize("raw", ["out", "a b/'q'/c", "$SCRATCH/o", "${SCRATCH}/x$EMPTY/y", "/abs/$SCRATCH",
                                 "~/runs/$SCRATCH", "~", "rel/$SCRATCH/z", "$SCRATCH", "a$$SCRATCH", "x/$SCRATCH-1"])
def test_the_shell_expands_output_path_as_batchrun_does(tmp_path, raw):
    base = tmp_path / "jobs dir"
    env = {"SCRATCH": "/s c/r", "EMPTY": "", "HOME": str(tmp_path / "home"), "PATH": os.environ["PATH"]}
    word = sl.shell_path(raw)
    script = f'set -euo pipefail\nout={word}\ncase "$out" in /*) ;; *) out={sl.shlex.quote(str(base))}/"$out" ;; esac\n' \
             'printf %s "$out"'
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, check=True).stdout
    old = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        want = _resolve(base, raw, "output.path")
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert os.path.normpath(got) == want


def test_a_variable_no_shell_can_expand_is_refused():
    with pytest.raises(ConfigError, match=r"output.path: \$\{A-B\}"):
        sl.shell_path("${A-B}/out")


def test_task_count_from_min_max_when_slurm_sets_no_count(monkeypatch):
    for k in SLURM_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MAX", "16")
    monkeypatch.setenv("SLURM_ARRAY_TASK_STEP", "4")
    assert slurm_task_defaults() == (2, 4)
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "4")
    assert slurm_task_defaults() == (2, 4)


def test_the_shipped_example_claims_at_run_time_and_logs_on_the_node(tmp_path, fake_batchrun):
    script = REPO / "jobs" / "slurm-array.sbatch"
    text = script.read_text()
    sbatch = re.findall(r"^#SBATCH (\S+)$", text, re.M)
    assert "--gpus-per-task=1" in sbatch and "--open-mode=append" in sbatch
    assert not any(o.startswith("--gpus=") for o in sbatch) and not any("$" in o for o in sbatch)
    r = run_script(script, SCRATCH=str(tmp_path / "scratch"), HOME=str(tmp_path), SLURM_ARRAY_JOB_ID="5",
                   SLURM_ARRAY_TASK_ID="2", SLURM_ARRAY_TASK_MIN="0", SLURM_ARRAY_TASK_COUNT="8")
    assert r.returncode == 0, r.stderr
    log = tmp_path / "scratch" / "nightly" / "out" / "_batchrun" / "slurm" / "5_2.out"
    assert log.read_text().splitlines()[0] == f"args: run {tmp_path}/jobs/nightly.yaml"  # no --num-tasks


def test_a_percent_in_the_output_path_is_not_a_slurm_pattern(tmp_path):
    job = sl.read_job(write_job(tmp_path, output="out%j"))
    text = sl.sbatch_script(job, 2, str(tmp_path / "job.sbatch"))
    assert f"#SBATCH --output={tmp_path}/out%%j/_batchrun/slurm/%A_%a.out\n" in text
