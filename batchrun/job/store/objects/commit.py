"""Exactly-once publishing on an object store, where nothing can be renamed.

A unit's part file is built in memory (a unit is bounded by rows_per_unit) and written to its
final key in one request: a single PUT, or above 64 MiB a multipart upload that the store shows
only once it is completed. So a visible part is always whole, and a retry or a rerun replaces it
whole. Only then is the unit's commit marker PUT (a marker is small: one PUT, atomic). The marker
records the part's size, sha256 and ETag; resume trusts it only while the part at the key still
has that size and ETag (one HEAD), and rewrites the unit otherwise, as the local protocol does
with size and mtime (store/commit.py).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.store.commit import PARQUET_MAGIC, Commits
from batchrun.job.store.layout import OutputDir, part_name

READ_THREADS = 16  # markers are small GETs: a few in flight hide the round trips


class Part:
    def __init__(self, table: pa.Table):
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        self.data = buf.getvalue()
        self.size = len(self.data)
        self.sha256 = hashlib.sha256(self.data).hexdigest()


def publish_part(out: OutputDir, store, unit: int, part: Part) -> str:
    """PUT the whole part file to its final key; its ETag."""
    return store.put(out.part(unit), part.data)


def record_commit(out: OutputDir, store, unit: int, info: dict) -> None:
    store.put(out.commit_marker(unit), json.dumps({"unit": unit, **info}, indent=1, sort_keys=True).encode())


def part_record(unit: int, part: Part, etag: str, fingerprint: str) -> dict:
    return {"part": part_name(unit), "size": part.size, "sha256": part.sha256, "etag": etag,
            "fingerprint": fingerprint}


def read_commits(out: OutputDir, store) -> Commits:
    got = Commits()
    names = []
    for obj in store.list(out.commits + "/"):
        name = obj.path.rsplit("/", 1)[1]
        if name.startswith("unit-") and name.endswith(".json"):
            try:
                names.append((int(name[5:-5]), obj.path, name))
            except ValueError:
                continue
    with ThreadPoolExecutor(READ_THREADS) as pool:
        bodies = list(pool.map(lambda n: store.get(n[1]), names))
    for (unit, _, name), body in zip(names, bodies):
        if body is None:
            continue  # deleted since the listing (a repair or a restart)
        try:
            marker = json.loads(body.data)
            if not isinstance(marker, dict) or not isinstance(marker.get("rows"), int):
                raise ValueError("not a commit marker")
            got.valid[unit] = marker
        except ValueError as e:
            got.damaged[unit] = f"commit marker {name} is unreadable ({e})"
    return got


def part_keys(out: OutputDir, store) -> set[str]:
    """Names of the part-*.parquet objects directly under output.path."""
    prefix = out.path.rstrip("/") + "/"
    return {o.path[len(prefix):] for o in store.list(prefix + "part-")
            if "/" not in o.path[len(prefix):]}


def uncommitted_parts(out: OutputDir, store, total_units: int, commits: Commits) -> list[int]:
    names = part_keys(out, store)
    return [u for u in range(total_units) if u not in commits.valid and part_name(u) in names]


def check_part(out: OutputDir, store, unit: int, marker: dict, fingerprint: str | None = None,
               full: bool = False) -> str | None:
    """Why the unit's part object cannot be trusted, or None. Cheap: one HEAD (size, ETag); with
    ``full`` (verify) the bytes are read: Parquet footer magic and sha256."""
    path = out.part(unit)
    name = os.path.basename(path)
    if fingerprint is not None and marker.get("fingerprint") not in (None, fingerprint):
        return f"{name}: its commit marker belongs to another job"
    info = store.stat(path)
    if info is None:
        return f"{name} is missing"
    size = marker.get("size")
    if size is not None and info.size != size:
        return f"{name} has {info.size} bytes, its commit recorded {size}"
    if not full:
        if marker.get("etag") not in (None, info.version):
            return f"{name} was replaced after it was committed (ETag differs)"
        return None
    got = store.get(path)
    if got is None:
        return f"{name} is missing"
    if len(got.data) < 12 or got.data[-4:] != PARQUET_MAGIC:
        return f"{name} is not a whole Parquet file (no footer)"
    digest = marker.get("sha256")
    if digest and hashlib.sha256(got.data).hexdigest() != digest:
        return f"{name} was modified after it was committed (sha256 differs)"
    return None
