"""Write (and optionally submit) an sbatch script that runs a job as a Slurm array, one GPU per task."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import uuid

from batchrun.errors import ConfigError
from batchrun.job.spec import JobSpec

TEMPLATE = """#!/usr/bin/env bash
# Written by `batchrun slurm`. One array task = one GPU = one share of the job's work units.
# Tasks write disjoint units into one output dataset; rerunning (or requeueing) a task resumes it.
#SBATCH --job-name={name}
#SBATCH --array=0-{last}
#SBATCH --ntasks=1{gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --mem={mem}
#SBATCH --time={time}
#SBATCH --output={logs}/%A_%a.out
#SBATCH --signal=B:TERM@{signal_before}
{extra}
# SIGTERM (B: = to this script, which exec's batchrun; {signal_before} s before the time limit, or scancel)
# makes batchrun stop without leaving a partial part file; the
# units it committed are kept and the next run of this task resumes after them.
# The task id is SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN; the task count SLURM_ARRAY_TASK_COUNT.
exec {batchrun} run {job} --num-tasks {n}{restart}
"""


DEFAULT_SIGNAL_BEFORE_S = 120
MAX_SIGNAL_BEFORE_S = 65535  # Slurm's --signal sig_time limit


def time_limit_s(value: str) -> int | None:
    """Seconds of a Slurm --time value (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS);
    None for 'infinite'/'unlimited'. ConfigError naming the formats otherwise."""
    text = value.strip().lower()
    if text in ("infinite", "unlimited"):
        return None
    has_days = "-" in text
    days, _, rest = text.partition("-") if has_days else ("", "", text)
    parts = rest.split(":")
    try:
        d = int(days) if has_days else 0
        nums = [int(x) for x in parts]
        if d < 0 or any(x < 0 for x in nums) or not 1 <= len(nums) <= 3:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--time: {value!r} is not a Slurm time limit (minutes, MM:SS, HH:MM:SS, "
                          "D-HH, D-HH:MM or D-HH:MM:SS)") from None
    if has_days:  # D-HH[:MM[:SS]]
        h, m, s = (nums + [0, 0])[:3]
        return d * 86400 + h * 3600 + m * 60 + s
    if len(nums) == 1:
        return nums[0] * 60  # plain minutes
    if len(nums) == 2:
        return nums[0] * 60 + nums[1]  # MM:SS
    return nums[0] * 3600 + nums[1] * 60 + nums[2]


def check_signal_before(signal_before: int, time: str) -> None:
    """The SIGTERM margin must be a valid sig_time and leave the task some time to run."""
    if not 0 <= signal_before <= MAX_SIGNAL_BEFORE_S:
        raise ConfigError(f"--signal-before must be 0..{MAX_SIGNAL_BEFORE_S} seconds (Slurm's --signal "
                          f"limit), got {signal_before}")
    limit = time_limit_s(time)
    if limit is not None and signal_before >= limit:
        raise ConfigError(f"--signal-before {signal_before} s is not shorter than --time {time} ({limit} s): "
                          "the task would be signalled before it starts; lower --signal-before or raise --time")


def sbatch_script(spec: JobSpec, array: int, *, cpus: int = 8, mem: str = "64G", time: str = "24:00:00",
                  partition: str | None = None, account: str | None = None, restart: bool = False,
                  gpus_per_task: int = 1, sbatch_args=(), signal_before: int = DEFAULT_SIGNAL_BEFORE_S) -> str:
    if array < 1:
        raise ConfigError(f"--array must be >= 1, got {array}")
    check_signal_before(signal_before, time)
    if gpus_per_task < 0:
        raise ConfigError(f"--gpus-per-task must be >= 0, got {gpus_per_task}")
    extra = []
    if partition:
        extra.append(f"#SBATCH --partition={partition}")
    if account:
        extra.append(f"#SBATCH --account={account}")
    for arg in sbatch_args:
        if "\n" in arg or not arg.startswith("-"):
            raise ConfigError(f"--sbatch-arg: {arg!r} is not one sbatch option (expected e.g. --qos=long)")
        extra.append(f"#SBATCH {arg}")
    # One token per written script: its tasks, requeues and resubmissions restart only once.
    restart_flag = f" --restart-token {uuid.uuid4().hex[:16]}" if restart else ""
    exe = shutil.which("batchrun") or f"{sys.executable} -m batchrun"
    return TEMPLATE.format(
        name=os.path.splitext(os.path.basename(spec.job_file))[0] or "batchrun", last=array - 1,
        cpus=cpus, mem=mem, time=time, logs=os.path.join(spec.output.path, "_batchrun", "slurm"),
        extra="\n".join(extra), batchrun=exe if " " in exe else shlex.quote(exe),
        job=shlex.quote(spec.job_file), n=array, restart=restart_flag, signal_before=signal_before,
        gpus=f"\n#SBATCH --gpus={gpus_per_task}" if gpus_per_task else "")  # one task per array element


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
