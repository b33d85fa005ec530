"""metrics.json and metrics/task-N.json on an object store (store/metrics.py's files).

A task PUTs its own file; the merge has no lock: it reads metrics.json's ETag, lists and reads
every task's file and the commit markers, and writes metrics.json with ``If-Match`` (or
``If-None-Match`` for the first), starting over when another merge landed in between. A merge
that listed before another task's file landed therefore fails its condition if that task's
merge landed first, and otherwise that task's later merge includes it: no run goes missing.
"""
from __future__ import annotations

import json

from batchrun.job.store.layout import OutputDir
from batchrun.job.store.metrics import runs_of, totals
from batchrun.job.store.objects.commit import read_commits

MERGE_TRIES = 20


def _json(got):
    try:
        return json.loads(got.data) if got is not None else None
    except ValueError:
        return None


def write_metrics(out: OutputDir, task_id, this_run: dict, total_units: int, total_rows: int,
                  samples_per_row: int = 1) -> None:
    store = out.store
    path = f"{out.task_metrics_dir}/task-{task_id}.json"
    runs = runs_of(_json(store.get(path))) + [{k: v for k, v in this_run.items() if k != "runs"}]
    store.put(path, json.dumps({**this_run, "runs": runs}, indent=1, sort_keys=True).encode())
    for _ in range(MERGE_TRIES):
        current = store.get(out.metrics)
        merged = job_metrics(out, total_units, total_rows, samples_per_row)
        body = json.dumps(merged, indent=1, sort_keys=True).encode()
        if current is None:
            done = store.put(out.metrics, body, if_none_match=True)
        else:
            done = store.put(out.metrics, body, if_match=current.etag)
        if done is not None:
            return
    raise OSError(f"{out.metrics}: {MERGE_TRIES} merges in a row met another worker's; it is rewritten "
                  "by the next run")


def job_metrics(out: OutputDir, total_units: int, total_rows: int, samples_per_row: int = 1) -> dict:
    store = out.store
    tasks = {}
    for obj in store.list(out.task_metrics_dir + "/"):
        name = obj.path.rsplit("/", 1)[1]
        if name.endswith(".json") and not name.startswith("."):
            task = _json(store.get(obj.path))
            if isinstance(task, dict):
                tasks[name[:-5]] = task
    return totals(read_commits(out, store).valid, tasks, total_units, total_rows, samples_per_row)
