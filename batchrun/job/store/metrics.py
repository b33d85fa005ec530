"""_batchrun/metrics.json and metrics/task-N.json: totals over committed units, and every run.

Each task owns its file (under its lock) and appends its run to ``runs``; metrics.json merges
all tasks' runs, so a job resumed five times shows five runs and concurrent tasks never race on
one history. The merge (read every task's file, write metrics.json) holds locks/metrics.lock:
otherwise a task that read the directory before another task's file landed could write its
merge last, and metrics.json would miss that task.
"""
from __future__ import annotations

import json
import os

from batchrun.job.store.commit import committed_units, write_json_atomic
from batchrun.job.store.lock import TaskLock, acquire_waiting
from batchrun.job.store.layout import OutputDir

MERGE_WAIT_S = 60.0  # a merge takes milliseconds; the OS drops a dead holder's lock


def write_metrics(out: OutputDir, task_id: int, this_run: dict, total_units: int, total_rows: int,
                  samples_per_row: int = 1) -> None:
    os.makedirs(out.task_metrics_dir, exist_ok=True)
    path = os.path.join(out.task_metrics_dir, f"task-{task_id}.json")
    runs = _previous_runs(path) + [{k: v for k, v in this_run.items() if k != "runs"}]
    write_json_atomic(path, {**this_run, "runs": runs})  # the last run, and every run so far
    merge = acquire_waiting(TaskLock(os.path.join(out.locks, "metrics.lock"), "merging metrics.json"),
                            MERGE_WAIT_S, poll=0.02)
    try:
        write_json_atomic(out.metrics, job_metrics(out, total_units, total_rows, samples_per_row))
    finally:
        merge.release()


def _previous_runs(path: str) -> list[dict]:
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return []
    return runs_of(old)


def runs_of(old) -> list[dict]:
    """The run history in a task's metrics file (``old``: its parsed JSON)."""
    if not isinstance(old, dict):
        return []
    runs = old.get("runs")
    if isinstance(runs, list):
        return [r for r in runs if isinstance(r, dict)]
    return [{k: v for k, v in old.items()}] if "task_id" in old else []  # a file from before histories


def job_metrics(out: OutputDir, total_units: int, total_rows: int, samples_per_row: int = 1) -> dict:
    """Totals over every committed unit, plus each task's last run.

    ``rows_*`` count input rows (a marker's ``rows``); ``output_rows_*`` the part files' rows, one
    per sample (``samples_per_row`` = sampling.n; every input row of a committed unit has all n,
    error rows included), and ``error_rows`` counts output rows too."""
    done = committed_units(out)
    tasks = {}
    if os.path.isdir(out.task_metrics_dir):
        for name in sorted(os.listdir(out.task_metrics_dir)):
            if name.endswith(".json") and not name.startswith("."):
                try:
                    with open(os.path.join(out.task_metrics_dir, name)) as f:
                        task = json.load(f)
                except (OSError, ValueError):
                    continue  # a damaged metrics file loses its history, never the run
                if isinstance(task, dict):
                    tasks[name[:-5]] = task
    return totals(done, tasks, total_units, total_rows, samples_per_row)


def totals(done: dict[int, dict], tasks: dict[str, dict], total_units: int, total_rows: int,
           samples_per_row: int = 1) -> dict:
    """metrics.json from the commit markers (``done``) and each task's file (``tasks``)."""
    rows_committed = sum(m["rows"] for m in done.values())
    return {
        "units_total": total_units, "units_committed": len(done),
        "rows_total": total_rows, "rows_committed": rows_committed,
        "output_rows_total": total_rows * samples_per_row, "output_rows_committed": rows_committed * samples_per_row,
        "error_rows": sum(m["error_rows"] for m in done.values()),
        "prompt_tokens": sum(m["prompt_tokens"] for m in done.values()),
        "output_tokens": sum(m["output_tokens"] for m in done.values()),
        "complete": len(done) == total_units,
        "tasks": {name: {k: v for k, v in t.items() if k != "runs"} for name, t in tasks.items()},
        "runs": sorted((r for t in tasks.values() for r in t.get("runs", [])), key=lambda r: r.get("started", 0)),
    }
