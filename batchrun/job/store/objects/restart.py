"""--restart on an object store: store/restart.py's order, with keys instead of files.

  1. ``_batchrun/restarting.json`` is PUT listing the part objects to delete (the names the old
     manifest's plan owns and the names its commit markers recorded); any run that finds it
     finishes the wipe first,
  2. the commit markers are deleted, 3. then those part objects (never another key under
     output.path: a user's ``part-mine.parquet`` is not ours), then the rest of ``_batchrun/``
     but the locks,
  4. the mark is deleted once the new manifest is in place (``end_wipe``).
No task may be running: a live task lease (not stale) refuses the restart.
"""
from __future__ import annotations

import json

from batchrun.job.store.layout import META, OutputDir
from batchrun.job.store.lock import LockBusy
from batchrun.job.store.objects.commit import read_commits
from batchrun.job.store.objects.lock import holder
from batchrun.job.store.restart import owned_parts


def check_no_active_task(out: OutputDir, store, lease_s: float) -> None:
    for obj in store.list(out.locks + "/task-"):
        owner = holder(store, obj.path, lease_s)
        if owner:
            raise LockBusy(f"--restart: a run is still active in {out.path} ({owner}, {obj.path}); stop it "
                           "before restarting (or wait until its lease goes stale)")


def begin_wipe(out: OutputDir, store, manifest: dict | None, lease_s: float) -> None:
    check_no_active_task(out, store, lease_s)
    store.put(out.restart_mark, json.dumps({"parts": owned_parts(read_commits(out, store), manifest)}).encode())
    finish_wipe(out, store)


def pending_wipe(out: OutputDir, store) -> bool:
    return store.stat(out.restart_mark) is not None


def finish_wipe(out: OutputDir, store) -> None:
    got = store.get(out.restart_mark)
    try:
        parts = json.loads(got.data)["parts"] if got is not None else None
    except (ValueError, KeyError, TypeError):
        parts = None
    if parts is None:
        parts = owned_parts(read_commits(out, store), None)
    store.delete_many([o.path for o in store.list(out.commits + "/")])
    store.delete_many([out.path.rstrip("/") + "/" + n for n in parts
                       if "/" not in n and n.startswith("part-") and n.endswith(".parquet")])
    meta = out.meta + "/"
    keep = (out.locks + "/", out.restart_mark)
    store.delete_many([o.path for o in store.list(meta) if not o.path.startswith(keep)])


def end_wipe(out: OutputDir, store) -> None:
    store.delete(out.restart_mark)


__all__ = ["META", "begin_wipe", "check_no_active_task", "end_wipe", "finish_wipe", "pending_wipe"]
