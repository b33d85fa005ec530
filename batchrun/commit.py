"""Exactly-once publishing of work units.

A unit's part file is written under ``_batchrun/tmp/`` (invisible to dataset readers), fsynced,
renamed into ``output.path`` and the directory fsynced; only then is the unit's commit marker
written (itself atomically: temp file, fsync, rename). Resume trusts markers only, so a crash
anywhere leaves either nothing visible, or a complete part file that the rerun rewrites under
the same name (rename replaces it atomically). A visible part file is never partial.
"""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.output import OutputDir


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj, tmp_dir: str | None = None) -> None:
    tmp_dir = tmp_dir or os.path.dirname(path)
    tmp = os.path.join(tmp_dir, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))


def write_part(out: OutputDir, task_id: int, unit: int, table: pa.Table) -> str:
    """Write the part file to this task's temp dir and fsync it; returns the temp path."""
    tmp = os.path.join(out.tmp(task_id), f"part-{unit:06d}.parquet.tmp")
    with open(tmp, "wb") as f:
        pq.write_table(table, f, compression="zstd")
        f.flush()
        os.fsync(f.fileno())
    return tmp


def publish_part(out: OutputDir, unit: int, tmp: str) -> str:
    """Rename the finished temp file into the dataset (atomic on one filesystem)."""
    final = out.part(unit)
    os.replace(tmp, final)
    fsync_path(out.path)
    return final


def record_commit(out: OutputDir, unit: int, info: dict) -> None:
    write_json_atomic(out.commit_marker(unit), {"unit": unit, **info})


def committed_units(out: OutputDir) -> dict[int, dict]:
    """{unit: marker} for every committed unit."""
    if not os.path.isdir(out.commits):
        return {}
    done = {}
    for name in os.listdir(out.commits):
        if name.startswith("unit-") and name.endswith(".json"):
            with open(os.path.join(out.commits, name)) as f:
                done[int(name[5:-5])] = json.load(f)
    return done
