"""`batchrun run JOB --workers N` / `--gpus 0,1,...|all`: N worker processes on one node over the
same unit claims, one GPU each (CUDA_VISIBLE_DEVICES), one combined progress line, Ctrl-C/SIGTERM
stops them all (exit 130), exit code the worst of theirs.

Each worker is an ordinary `batchrun run JOB --task-id i --num-tasks N` child; the claims
(batchrun/job/store/claims.py) share the units. A GPU worker checks at start that exactly its one device is
visible (``check_worker_device``), so a wrong binding fails loudly instead of stacking workers on
one GPU. CPU workers get OMP_NUM_THREADS = their share of the node's CPUs (engine/cpu_threads.py),
unless the user set it, so N engines do not each size their thread pool to the whole node.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Sequence

from batchrun.engine.cpu_threads import EXPLICIT, worker_threads
from batchrun.errors import ConfigError
from batchrun.job.run.interrupt import Interrupted

GPU_ENV = "BATCHRUN_WORKER_GPU"  # the device a worker was bound to (set by the parent)


def visible_gpus(env=os.environ, count: Callable[[], int] | None = None) -> list[str]:
    """The node's GPUs: CUDA_VISIBLE_DEVICES when set, else 0..count()-1 (torch's device count)."""
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d.strip() for d in cvd.split(",") if d.strip() and d.strip() != "-1"]
    if count is None:
        import torch
        count = torch.cuda.device_count
    return [str(i) for i in range(count())]


def pick_gpus(gpus: str | None, workers: int | None, available: Sequence[str]) -> list[str | None]:
    """One entry per worker: its GPU, or None for a CPU worker."""
    if gpus is None:
        if workers is None or workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {workers}")
        return [None] * workers
    if gpus.strip() == "all":
        chosen = list(available)
        if not chosen:
            raise ConfigError("--gpus all: no GPU is visible on this node (CUDA_VISIBLE_DEVICES / torch); "
                              "use --workers N for CPU workers")
    else:
        chosen = [g.strip() for g in gpus.split(",") if g.strip()]
        if not chosen or len(set(chosen)) != len(chosen):
            raise ConfigError(f"--gpus {gpus!r}: expected distinct device ids like 0,1,2 or 'all'")
        missing = [g for g in chosen if g not in available]
        if missing:
            raise ConfigError(f"--gpus {gpus!r}: device(s) {', '.join(missing)} not visible on this node "
                              f"(visible: {', '.join(available) or 'none'})")
    if workers is not None and workers != len(chosen):
        raise ConfigError(f"--workers {workers} and --gpus {gpus!r} ({len(chosen)} devices) disagree: "
                          "give one of them, or as many workers as GPUs")
    return list(chosen)


def check_worker_device(env=os.environ, count: Callable[[], int] | None = None) -> None:
    """Inside a worker started with a GPU: exactly that one device must be visible."""
    want = env.get(GPU_ENV)
    if not want:
        return
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd != want:
        raise ConfigError(f"worker bound to GPU {want} sees CUDA_VISIBLE_DEVICES={cvd!r}; "
                          "something between `batchrun run --gpus` and the worker changed it")
    if count is None:
        import torch
        count = torch.cuda.device_count
    n = count()
    if n != 1:
        raise ConfigError(f"worker bound to GPU {want} sees {n} CUDA devices (expected exactly 1); "
                          "check that device id exists (nvidia-smi -L)")


def worst(codes: Sequence[int]) -> int:
    """The exit code of the whole: 0 only if all are 0; else the highest (a signal death = 128+sig)."""
    norm = [128 - c if c < 0 else c for c in codes]
    return max(norm, default=0)


def run_workers(cmd: Sequence[str], devices: Sequence[str | None], out_path: str,
                log: Callable[[str], None], interval: float = 30.0, env=None,
                storage_options=None) -> int:
    """Start one child per entry of ``devices`` (``cmd`` + --task-id i --num-tasks N), print one
    combined progress line every ``interval`` s, and return the worst exit code (130 if stopped).
    out_path: the output (a directory or an s3:// prefix, with its storage_options)."""
    from batchrun.job.store.layout import OutputDir
    out = OutputDir(out_path, storage_options)
    n = len(devices)
    base = dict(os.environ if env is None else env)
    procs: list[subprocess.Popen] = []
    try:
        for i, dev in enumerate(devices):
            e = dict(base)
            if dev is None:
                e.pop(GPU_ENV, None)
                if not any(e.get(v) for v in EXPLICIT):  # N engines share the CPUs, not N x all of them
                    e["OMP_NUM_THREADS"] = str(worker_threads(n, e))
            else:
                e["CUDA_VISIBLE_DEVICES"] = e[GPU_ENV] = dev
            procs.append(subprocess.Popen([*cmd, "--task-id", str(i), "--num-tasks", str(n)], env=e))
        log(f"workers: started {n} ({', '.join('gpu ' + d if d else 'cpu' for d in devices)})")
        last = time.time()
        while any(p.poll() is None for p in procs):
            time.sleep(0.05)
            if time.time() - last >= interval:
                last = time.time()
                log(_line(procs, out))
        log(_line(procs, out))
        return worst([p.returncode for p in procs])
    except Interrupted:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # each stops after its current commit, exit 130
        deadline = time.time() + 60
        for p in procs:
            try:
                p.wait(max(deadline - time.time(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return 130


def _line(procs, out) -> str:
    from batchrun.errors import OutputIOError
    try:  # commit markers and the manifest of a local output or an s3:// prefix
        done = len(out.backend.read_commits().valid)
        total = out.backend.read_json(out.manifest).get("total_units", "?")
    except (OSError, ValueError, OutputIOError):
        done, total = 0, "?"
    running = sum(p.poll() is None for p in procs)
    codes = [p.returncode for p in procs if p.returncode is not None]
    return (f"{time.strftime('%Y-%m-%dT%H:%M:%S')} workers: {running}/{len(procs)} running, units {done}/{total} "
            f"committed" + (f", exited: {', '.join(map(str, codes))}" if codes else ""))


def worker_command() -> list[str]:
    return [sys.executable, "-m", "batchrun"]
