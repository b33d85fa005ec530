"""How many intra-op threads the CPU engine uses (torch.set_num_threads), chosen once per process.

torch sizes its pool from the machine's cores. On a shared machine that is the wrong number: a
Slurm task (--cpus-per-task), taskset or a container (cgroup cpu.max) may own fewer cores than
the machine has, and the engine's own feeder (reads and tokenizes ahead) and writer threads need
a core beside the pool. An OpenMP pool with more threads than free cores waits at every barrier
for a thread the scheduler has parked, so one step can take many times longer than with fewer
threads (docs/scaling.md "CPU threads" has the measurements).

The default is one thread per CPU this process may use (the smallest of the affinity mask, the
cgroup quota and SLURM_CPUS_PER_TASK), less one left for the feeder and writer, and at least one.
The count is only ever lowered: a smaller torch.set_num_threads made before the engine starts is
kept. OMP_NUM_THREADS or MKL_NUM_THREADS, when set, win and are left to torch. The choice is
printed once to stderr.
"""
from __future__ import annotations

import math
import os
import sys

EXPLICIT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
CGROUP_V2 = "/sys/fs/cgroup/cpu.max"  # "max 100000" or "<quota_us> <period_us>"
CGROUP_V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")

_reported = False


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpus(v2: str = CGROUP_V2, v1: tuple[str, str] = CGROUP_V1) -> int | None:
    """CPUs the cgroup's CFS quota allows (quota / period, rounded up), None when unlimited/unknown."""
    text = _read(v2)
    if text is not None:
        fields = text.split()
        quota, period = (fields + ["", ""])[:2]
    else:
        quota, period = _read(v1[0]) or "", _read(v1[1]) or ""
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max", missing files, or an unreadable value: no quota
        return None
    if q <= 0 or p <= 0:  # v1 writes -1 for no quota
        return None
    return max(1, math.ceil(q / p))


def available_cpus(env=os.environ) -> tuple[int, str]:
    """(CPUs this process may use, what limited it) from affinity, cgroup quota and Slurm."""
    try:
        limits = {"affinity": len(os.sched_getaffinity(0))}
    except AttributeError:  # not Linux
        limits = {"cores": os.cpu_count() or 1}
    quota = cgroup_cpus()
    if quota is not None:
        limits["cgroup cpu.max"] = quota
    slurm = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if slurm.isdigit() and int(slurm) > 0:
        limits["SLURM_CPUS_PER_TASK"] = int(slurm)
    n = min(limits.values())
    return n, ", ".join(f"{k} {v}" for k, v in limits.items())


def default_threads(cpus: int) -> int:
    """One per CPU, less one for the feeder and writer threads, at least one."""
    return max(1, cpus - 1)


def worker_threads(workers: int, env=os.environ) -> int:
    """Threads for each of ``workers`` CPU engines sharing this node (`run --workers N`): an equal
    share of the CPUs, less one for each worker's feeder and writer, at least one."""
    cpus, _ = available_cpus(env)
    return max(1, cpus // workers - 1)


def limit_cpu_threads(env=os.environ) -> int | None:
    """Set the CPU engine's intra-op thread count (see the module docstring); returns it, or None
    when OMP_NUM_THREADS / MKL_NUM_THREADS decide. Prints the choice once per process."""
    import torch  # here, so that a --workers parent can size its workers without importing torch
    explicit = [f"{v}={env[v]}" for v in EXPLICIT if env.get(v)]
    if explicit:
        _report(f"{torch.get_num_threads()} (from {', '.join(explicit)})")
        return None
    cpus, why = available_cpus(env)
    n = default_threads(cpus)
    current = torch.get_num_threads()
    if current <= n:  # torch's own default (physical cores) or a torch.set_num_threads call: keep it
        _report(f"{current} (torch's setting; {cpus} CPU(s) available: {why})")
        return current
    torch.set_num_threads(n)
    _report(f"{n} ({cpus} CPU(s) available: {why}; one left for the feeder and writer; "
            "OMP_NUM_THREADS overrides)")
    return n


def _report(text: str) -> None:
    global _reported
    if not _reported:
        _reported = True
        print(f"batchrun: CPU engine threads: {text}", file=sys.stderr, flush=True)
