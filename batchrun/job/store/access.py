"""Reading an output, local or on an object store: what `verify`, `status` and `show` need.

Each function answers for either kind of output.path with the same meaning: local outputs through
store/commit.py and the lock files, prefixes through store/objects/ and their leases.
"""
from __future__ import annotations

import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.store import commit as local
from batchrun.job.store.layout import OutputDir
from batchrun.job.store.objects import commit as objects


def read_commits(out: OutputDir) -> local.Commits:
    return objects.read_commits(out, out.store) if out.is_object else local.read_commits(out)


def check_part(out: OutputDir, unit: int, marker: dict, fingerprint: str | None = None, full: bool = False):
    if out.is_object:
        return objects.check_part(out, out.store, unit, marker, fingerprint, full)
    return local.check_part(out, unit, marker, fingerprint, full)


def uncommitted_parts(out: OutputDir, total_units: int, commits: local.Commits) -> list[int]:
    if out.is_object:
        return objects.uncommitted_parts(out, out.store, total_units, commits)
    return local.uncommitted_parts(out, total_units, commits)


def open_part(out: OutputDir, unit: int) -> pq.ParquetFile:
    """A unit's part file, open for reading (an object is fetched whole: parts are unit-sized)."""
    if not out.is_object:
        return pq.ParquetFile(out.part(unit))
    got = out.store.get(out.part(unit))
    if got is None:
        raise FileNotFoundError(2, "no such object", out.part(unit))
    return pq.ParquetFile(io.BytesIO(got.data))


def read_part(out: OutputDir, unit: int, columns=None) -> pa.Table:
    if not out.is_object:
        return pq.read_table(out.part(unit), columns=columns)
    return open_part(out, unit).read(columns=columns)


def read_json(out: OutputDir, path: str):
    """The parsed JSON at ``path``; FileNotFoundError when there is none."""
    if not out.is_object:
        with open(path) as f:
            return json.load(f)
    got = out.store.get(path)
    if got is None:
        raise FileNotFoundError(2, "no such object", path)
    return json.loads(got.data)


def running_tasks(out: OutputDir) -> list[str]:
    """'task-N (owner)' for every task whose lock (or live lease) is held now."""
    from batchrun.job.store.claims import lease_from_env
    found = []
    if out.is_object:
        from batchrun.job.store.objects.lock import holder
        for obj in out.store.list(out.locks + "/task-"):
            name = obj.path.rsplit("/", 1)[1]
            if owner := holder(out.store, obj.path, lease_from_env()):
                found.append(f"{name[:-5]} ({owner})")
        return found
    from batchrun.job.store.lock import is_locked
    if os.path.isdir(out.locks):
        for name in sorted(os.listdir(out.locks)):
            if name.startswith("task-") and (owner := is_locked(os.path.join(out.locks, name))):
                found.append(f"{name[:-5]} ({owner})")
    return found
