"""Write (and optionally submit) an sbatch script that runs a job as a Slurm array, one GPU per task."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

from batchrun.errors import ConfigError
from batchrun.job import JobSpec

TEMPLATE = """#!/usr/bin/env bash
# Written by `batchrun slurm`. One array task = one GPU = one share of the job's work units.
# Tasks write disjoint units into one output dataset; rerunning (or requeueing) a task resumes it.
#SBATCH --job-name={name}
#SBATCH --array=0-{last}
#SBATCH --ntasks=1
#SBATCH --gpus=1
#SBATCH --cpus-per-task={cpus}
#SBATCH --mem={mem}
#SBATCH --time={time}
#SBATCH --output={logs}/%A_%a.out
#SBATCH --signal=B:TERM@120
{extra}
# SIGTERM (B: = to this script, which exec's batchrun; 120 s before the time limit, or scancel)
# makes batchrun stop without leaving a partial part file; the
# units it committed are kept and the next run of this task resumes after them.
# The task id is SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN; the task count SLURM_ARRAY_TASK_COUNT.
exec {batchrun} run {job} --num-tasks {n}{restart}
"""


def sbatch_script(spec: JobSpec, array: int, *, cpus: int = 8, mem: str = "64G", time: str = "24:00:00",
                  partition: str | None = None, account: str | None = None, restart: bool = False) -> str:
    if array < 1:
        raise ConfigError(f"--array must be >= 1, got {array}")
    extra = []
    if partition:
        extra.append(f"#SBATCH --partition={partition}")
    if account:
        extra.append(f"#SBATCH --account={account}")
    exe = shutil.which("batchrun") or f"{sys.executable} -m batchrun"
    return TEMPLATE.format(
        name=os.path.splitext(os.path.basename(spec.job_file))[0] or "batchrun", last=array - 1,
        cpus=cpus, mem=mem, time=time, logs=os.path.join(spec.output.path, "_batchrun", "slurm"),
        extra="\n".join(extra), batchrun=exe if " " in exe else shlex.quote(exe),
        job=shlex.quote(spec.job_file), n=array, restart=" --restart" if restart else "")


def write_script(spec: JobSpec, path: str, text: str) -> str:
    os.makedirs(os.path.join(spec.output.path, "_batchrun", "slurm"), exist_ok=True)  # log dir
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    return path


def submit(path: str) -> str:
    if shutil.which("sbatch") is None:
        raise ConfigError("--submit: sbatch is not on PATH (is this a Slurm login node?); "
                          f"the script is at {path}")
    proc = subprocess.run(["sbatch", path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"sbatch {path} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip()
