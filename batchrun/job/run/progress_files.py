"""Per-worker progress files: ``_batchrun/progress/<worker>.json``, read by `batchrun status`.

Each worker rewrites its own file (atomically) when it starts, after a commit at most every
``WRITE_EVERY_S`` seconds, and when it ends, so one `status` call shows every worker of an output
directory (any node, any array) without asking Slurm. The file is a snapshot; what is live comes
from elsewhere: the units a worker holds now are counted from the claim files, and a file that
says "running" while its worker's lock is free belongs to a worker that died (kill -9, node loss).
"""
from __future__ import annotations

import os
import socket
import threading
import time

from batchrun.job.store.layout import OutputDir

WRITE_EVERY_S = 5.0  # a commit rewrites the file at most this often (one small write per worker)


def progress_dir(out: OutputDir) -> str:
    return os.path.join(out.meta, "progress")


class ProgressFile:
    """The writer side: ``update(stats, force)`` from the engine and writer threads."""

    def __init__(self, out: OutputDir, worker: str, clock=time.time):
        self.path = os.path.join(progress_dir(out), f"{worker}.json")
        self.worker, self.clock = worker, clock
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._mu = threading.Lock()  # one temp-file name per process: the threads take turns
        self._last = float("-inf")
        self._write = out.backend.progress_writer(progress_dir(out))

    def update(self, st, force: bool = False) -> None:
        """Write ``st`` (runner.TaskStats) unless the last write was under WRITE_EVERY_S ago."""
        with self._mu:
            now = self.clock()
            if not force and now - self._last < WRITE_EVERY_S:
                return
            ready = st.started + st.startup_s if st.startup_s else None  # the engine is loaded
            gen_s = max(now - ready, 1e-9) if ready is not None else 0.0
            self._write(self.path, {
                "worker": self.worker, "task_id": st.task_id, "host": self.host, "pid": self.pid,
                "status": st.status, "started": st.started, "updated": now,
                "units_done": st.units_done, "input_rows": st.input_rows, "output_rows": st.output_rows,
                "error_rows": st.error_rows, "output_tokens": st.output_tokens,
                "output_rows_per_s": st.output_rows / gen_s if gen_s else 0.0,
                "output_tok_per_s": st.output_tokens / gen_s if gen_s else 0.0,
            })
            self._last = now


def read_progress(out: OutputDir) -> list[dict]:
    """Every worker's last snapshot (unreadable files skipped: a status report never fails on one)."""
    return [data for data in out.backend.read_jsons(progress_dir(out), suffix=".json")
            if isinstance(data.get("worker"), str)]


def claims_by_worker(out: OutputDir) -> dict[str, int]:
    """Units each worker holds a claim on right now (the claim files name their owner)."""
    held: dict[str, int] = {}
    for data in out.backend.read_jsons(out.claims, prefix="unit-"):
        if isinstance(data.get("worker"), str):
            held[data["worker"]] = held.get(data["worker"], 0) + 1
    return held


HEADER = ["worker", "state", "host", "units done", "claimed now", "rows", "rows/s", "out tok/s", "updated"]


def worker_rows(out: OutputDir, now: float | None = None) -> list[list]:
    """One row per worker for `status` (HEADER's columns). ``rows`` are output rows (one per
    sample); ``state`` is the file's status, or "died" for a running one whose lock is free."""
    now = time.time() if now is None else now
    backend = out.backend
    held = claims_by_worker(out)
    rows = []
    for p in read_progress(out):
        state = p.get("status", "?")
        if state == "running" and backend.task_holder(p["worker"]) is None:
            state = "died"  # killed without its final write: its claims expire with their lease
        age = max(now - float(p.get("updated") or now), 0.0)
        rows.append([p["worker"], state, p.get("host", "?"), p.get("units_done", 0), held.pop(p["worker"], 0),
                     p.get("output_rows", 0), f"{float(p.get('output_rows_per_s') or 0):.1f}",
                     f"{float(p.get('output_tok_per_s') or 0):.0f}", f"{age:.0f}s ago"])
    for worker, n in sorted(held.items()):  # claims of a worker that has not written its file yet
        rows.append([worker, "starting", "?", 0, n, 0, "-", "-", "-"])
    return rows
