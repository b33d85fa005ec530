"""Write (and optionally submit) an sbatch script that runs a job as a Slurm array.

Everything that depends on the node is left to the node: ``$VARS`` and ``~`` in output.path are
expanded by the batch shell when the task starts (as batchrun expands them in the same
environment), the task id and count come from the SLURM_ARRAY_* variables at run time, and the
GPU request follows the job's engine.device. So the script can be written on a login node where
``$SCRATCH`` is unset, and one script fits any array size (`sbatch --array=0-15 job.sbatch`).

Logs: Slurm's own ``--output=%A_%a.out`` pattern (array job id, task id), opened in append mode so
a requeued task adds to its log. Where output.path is known when the script is written, that file
is ``<output>/_batchrun/slurm/%A_%a.out``; where it needs run-time expansion, Slurm's file is next
to the script and the script sends batchrun's output to the same name under the expanded
``<output>/_batchrun/slurm/`` (Slurm cannot expand variables in ``--output``). An object-store
output (``s3://...``) has no directory for logs: they stay next to the script,
``<job name>-%A_%a.out``.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from batchrun.engine.config import DEVICES
from batchrun.errors import ConfigError
from batchrun.job.jobfile.safe_yaml import load_yaml
from batchrun.job.jobfile.spec import _ENV_REF, load_job
from batchrun.job.storage.uri import is_uri

HEADER = """#!/usr/bin/env bash
# Written by `batchrun slurm` for {job_file}.
# One array task = one worker. Every task plans the same work units and claims them one at a time
# (README "Unit claims"), so tasks never write the same unit, a slow or preempted task leaves no
# work idle, and this script runs unchanged with another array size (sbatch --array=0-15 ...).
# Rerunning, requeueing or resubmitting a task resumes after the units already committed.
#SBATCH --job-name={name}
#SBATCH --array=0-{last}
#SBATCH --ntasks=1{gpus}
#SBATCH --cpus-per-task={cpus}
#SBATCH --mem={mem}
#SBATCH --time={time}
#SBATCH --output={slurm_log}
#SBATCH --open-mode=append
#SBATCH --signal=B:TERM@{signal_before}
{extra}
# SIGTERM (B: = to this script, which exec's batchrun; {signal_before} s before the time limit, or scancel)
# makes batchrun stop without leaving a partial part file; the
# units it committed are kept and the next run of this task resumes after them.
# batchrun reads its place in the array at run time: task id = (SLURM_ARRAY_TASK_ID -
# SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP, task count = SLURM_ARRAY_TASK_COUNT (else
# (SLURM_ARRAY_TASK_MAX - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP + 1). They only choose
# where a task starts claiming; any number of tasks may share the units.
set -euo pipefail
"""

REDIRECT = """# output.path is expanded here, on the node, as batchrun expands it; batchrun's log goes to
# <output>/_batchrun/slurm/<array job id>_<task id>.out (appended to, like Slurm's --output above).
out={out_word}
case "$out" in /*) ;; *) out={base}/"$out" ;; esac
mkdir -p "$out/_batchrun/slurm"
exec >>"$out/_batchrun/slurm/${{SLURM_ARRAY_JOB_ID:?run this script with sbatch}}_${{SLURM_ARRAY_TASK_ID:?run this script with sbatch}}.out" 2>&1
"""

OBJECT_LOG = """# output.path is an object-store URI, which has no folder for logs: each task's log stays at
# {log} (appended to).
"""

RUN = "exec {batchrun} run {job}{restart}\n"

DEFAULT_SIGNAL_BEFORE_S = 120
MAX_SIGNAL_BEFORE_S = 65535  # Slurm's --signal sig_time limit
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class SlurmJob:
    """What the script needs from job.yaml, read without expanding any variable."""
    job_file: str  # absolute
    output_path: str  # as written in the job file
    device: str  # engine.device as written (auto when absent)
    unset: tuple[str, ...] = ()  # variables the job's paths name that are unset here

    @property
    def base_dir(self) -> str:
        return os.path.dirname(self.job_file)

    @property
    def object_output(self) -> bool:
        """output.path is an object-store URI (its scheme is literal even where its key names $VARS)."""
        return is_uri(self.output_path)

    @property
    def static_output(self) -> str | None:
        """output.path resolved now, when it is a local path naming no variable and no home
        directory; else None."""
        raw = self.output_path
        if self.object_output or _ENV_REF.search(raw) or raw == "~" or raw.startswith("~/"):
            return None
        return os.path.normpath(os.path.join(self.base_dir, os.path.expanduser(raw)))


def read_job(path: str | os.PathLike) -> SlurmJob:
    """The fields the script needs, read from the job file as written. The whole job is checked
    (load_job) when every variable its paths name is set here; otherwise the tasks check it when
    they start, and ``unset`` says which variables were missing."""
    path = Path(path).absolute()
    try:
        raw = load_yaml(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read job file {path}: {e.strerror or e}") from None
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e)[:600]}") from None
    raw = raw if isinstance(raw, dict) else {}
    out = raw.get("output") if isinstance(raw.get("output"), dict) else {}
    opath = out.get("path")
    eng = raw.get("engine") if isinstance(raw.get("engine"), dict) else {}
    device = eng.get("device", "auto")
    paths = [raw.get("model"), opath, (raw.get("input") or {}).get("path") if isinstance(raw.get("input"), dict) else None]
    if isinstance(raw.get("adapters"), dict):
        paths += list(raw["adapters"].values())
    unset = sorted({m.group(1).strip("{}") for p in paths if isinstance(p, str) for m in _ENV_REF.finditer(p)}
                   - set(os.environ))
    if not unset:
        load_job(path)  # the whole job, with its own messages
    if not isinstance(opath, str) or not opath.strip():
        raise ConfigError(f"{path}: output.path: required (a string: the output directory)")
    if device not in DEVICES:
        raise ConfigError(f"{path}: engine.device: expected one of {', '.join(DEVICES)}, got {device!r}")
    return SlurmJob(job_file=str(path), output_path=opath, device=device, unset=tuple(unset))


def shell_path(raw: str) -> str:
    """A bash word that expands ``raw`` at run time as spec._resolve does: ``$NAME``/``${NAME}``
    from the environment (an unset one stops the script, naming it), a leading ``~`` as $HOME;
    the rest quoted literally. Relative results are resolved against the job file's directory by
    the caller."""
    parts, rest = [], raw
    if rest == "~" or rest.startswith("~/"):
        parts.append('"${HOME}"')
        rest = rest[1:]
    elif rest.startswith("~"):
        rest = os.path.expanduser(rest)  # ~user: the password database, the same on every node
    pos = 0
    for m in _ENV_REF.finditer(rest):
        if m.start() > pos:
            parts.append(shlex.quote(rest[pos:m.start()]))
        name = m.group(1).strip("{}")
        if not _SHELL_NAME.match(name):
            raise ConfigError(f"output.path: {m.group(0)} is not a variable a shell can expand (letters, digits "
                              "and _, not starting with a digit); write that part of the path out")
        parts.append(f'"${{{name}?is not set on this node (output.path of the job)}}"')
        pos = m.end()
    if pos < len(rest):
        parts.append(shlex.quote(rest[pos:]))
    return "".join(parts)


def gpus_for(job: SlurmJob, gpus_per_task: int | None) -> int:
    """GPUs per task: the job's device decides by default (cpu: none; auto or cuda: one)."""
    if gpus_per_task is None:
        return 0 if job.device == "cpu" else 1
    if gpus_per_task < 0:
        raise ConfigError(f"--gpus-per-task must be >= 0, got {gpus_per_task}")
    if gpus_per_task > 0 and job.device == "cpu":
        raise ConfigError(f"--gpus-per-task {gpus_per_task}: {job.job_file} sets engine.device: cpu, so the "
                          "tasks would hold GPUs they never use; drop --gpus-per-task (or use 0), or set "
                          "engine.device: auto")
    return gpus_per_task


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


def log_name(job: SlurmJob) -> str:
    """The job file's name without its extension: the Slurm job name and the logs' prefix."""
    return os.path.splitext(os.path.basename(job.job_file))[0] or "batchrun"


def slurm_log_dir(job: SlurmJob, script_path: str) -> str:
    """Where Slurm writes %A_%a.out: the output's log folder when known now, else (a variable in a
    local output.path, or an object-store output) next to the script."""
    static = job.static_output
    if static is not None:
        return os.path.join(static, "_batchrun", "slurm")
    return os.path.dirname(os.path.abspath(script_path))


def sbatch_script(job: SlurmJob, array: int, script_path: str, *, cpus: int = 8, mem: str = "64G",
                  time: str = "24:00:00", partition: str | None = None, account: str | None = None,
                  restart: bool = False, gpus_per_task: int | None = None, sbatch_args=(),
                  signal_before: int = DEFAULT_SIGNAL_BEFORE_S) -> str:
    if array < 1:
        raise ConfigError(f"--array must be >= 1, got {array}")
    check_signal_before(signal_before, time)
    gpus = gpus_for(job, gpus_per_task)
    extra = []
    if partition:
        extra.append(f"#SBATCH --partition={partition}")
    if account:
        extra.append(f"#SBATCH --account={account}")
    for arg in sbatch_args:
        if "\n" in arg or not arg.startswith("-"):
            raise ConfigError(f"--sbatch-arg: {arg!r} is not one sbatch option (expected e.g. --qos=long)")
        extra.append(f"#SBATCH {arg}")
    name = log_name(job)
    log_dir = slurm_log_dir(job, script_path)
    # One token per written script: its tasks, requeues and resubmissions restart only once.
    restart_flag = f" --restart-token {uuid.uuid4().hex[:16]}" if restart else ""
    exe = shutil.which("batchrun") or f"{sys.executable} -m batchrun"
    text = HEADER.format(
        job_file=job.job_file.replace("\n", " "), name=name, last=array - 1, cpus=cpus, mem=mem, time=time,
        slurm_log=os.path.join(log_dir.replace("%", "%%"),  # a literal % in a path, not a Slurm pattern
                               "%A_%a.out" if job.static_output else f"{name.replace('%', '%%')}-%A_%a.out"),
        extra="\n".join(extra), signal_before=signal_before,
        gpus=f"\n#SBATCH --gpus-per-task={gpus}" if gpus else "")
    if job.object_output:
        text += OBJECT_LOG.format(log=os.path.join(log_dir, f"{name}-<array job id>_<task id>.out"))
    elif job.static_output is None:
        text += REDIRECT.format(out_word=shell_path(job.output_path), base=shlex.quote(job.base_dir))
    return text + RUN.format(batchrun=exe if " " in exe else shlex.quote(exe), job=shlex.quote(job.job_file),
                             restart=restart_flag)


def write_script(job: SlurmJob, path: str, text: str) -> str:
    os.makedirs(slurm_log_dir(job, path), exist_ok=True)  # Slurm opens --output before the script runs
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
