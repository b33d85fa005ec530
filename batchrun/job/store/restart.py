"""--restart: delete the previous run's outputs, crash-safely and only what batchrun wrote.

Order matters, because a rerun trusts what it finds:
  1. ``_batchrun/restarting.json`` is written (atomically) listing the part files to delete: the
     names the manifest's plan owns (``part-NNNNNN.parquet`` for its units) and the names the
     commit markers recorded. From here on, any run that finds the mark finishes the wipe first.
  2. commit markers go (so no unit is believed committed while its part is being deleted),
  3. then those part files (never anything else in output.path: a user's ``part-mine.parquet``
     or another job's files are not ours), then the rest of ``_batchrun/`` (locks and slurm logs
     stay: a task of the array may be holding its lock, the logs belong to the running array),
  4. the mark goes last, once the new manifest is written (``end_wipe``): until then every run
     knows the directory is this job's, being restarted, even though its manifest is gone.
Nothing is followed through a symlink: links are unlinked, never descended.
"""
from __future__ import annotations

import json
import os
import shutil

from batchrun.job.store.commit import fsync_path, read_commits, write_json_atomic
from batchrun.job.store.lock import LockBusy, is_locked
from batchrun.job.store.layout import OutputDir, part_name

KEEP = ("locks", "slurm")


def owned_parts(commits, manifest: dict | None) -> list[str]:
    """The part names a restart deletes: those the manifest's plan owns and those the commit
    markers (``commits``: read_commits of either kind of output) recorded, nothing else."""
    names = set()
    total = (manifest or {}).get("total_units")
    if isinstance(total, int) and total >= 0:
        names.update(part_name(u) for u in range(total))
    for unit, marker in commits.valid.items():
        names.add(part_name(unit))
        recorded = marker.get("part")
        if isinstance(recorded, str) and "/" not in recorded:  # a bare name, never a path
            names.add(recorded)
    names.update(part_name(u) for u in commits.damaged)
    return sorted(n for n in names if n.startswith("part-") and n.endswith(".parquet"))


def check_no_active_task(out: OutputDir) -> None:
    if os.path.isdir(out.locks):
        for name in sorted(os.listdir(out.locks)):
            if name.startswith("task-") and (owner := is_locked(os.path.join(out.locks, name))):
                raise LockBusy(f"--restart: a run is still active in {out.path} ({owner}, {name}); "
                               "stop it before restarting")


def begin_wipe(out: OutputDir, manifest: dict | None) -> None:
    """Step 1, then the rest (called under the manifest lock, with no task running)."""
    check_no_active_task(out)
    write_json_atomic(out.restart_mark, {"parts": owned_parts(read_commits(out), manifest)})
    finish_wipe(out)


def pending_wipe(out: OutputDir) -> bool:
    return os.path.lexists(out.restart_mark)


def _remove(path: str) -> None:
    """Unlink a file or link; delete a real directory's tree (rmtree does not follow links)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def finish_wipe(out: OutputDir) -> None:
    """Steps 2-3, from the mark's list; safe to repeat after a crash at any point."""
    try:
        with open(out.restart_mark) as f:
            parts = json.load(f)["parts"]
    except (OSError, ValueError, KeyError, TypeError):
        parts = None  # a damaged mark (a crash while writing it is impossible: it is atomic)
    if parts is None:
        parts = owned_parts(read_commits(out), None)
    _remove(out.commits)
    for name in parts:
        if name == os.path.basename(name) and name.startswith("part-") and name.endswith(".parquet"):
            _remove(os.path.join(out.path, name))
    fsync_path(out.path)
    for name in os.listdir(out.meta):
        if name not in KEEP and name != os.path.basename(out.restart_mark):
            _remove(os.path.join(out.meta, name))
    fsync_path(out.meta)


def end_wipe(out: OutputDir) -> None:
    """Step 4: the new manifest is in place, the restart is over."""
    os.remove(out.restart_mark)
    fsync_path(out.meta)
