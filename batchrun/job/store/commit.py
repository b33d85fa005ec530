"""Exactly-once publishing of work units, and checking what was published.

A unit's part file is written under ``_batchrun/tmp/`` (invisible to dataset readers), fsynced,
renamed into ``output.path`` and the directory fsynced; only then is the unit's commit marker
written (itself atomically: temp file, fsync, rename). A marker records the part file's size,
mtime and sha256 and the job fingerprint, so resume trusts a marker only when its part file is
still there, whole and unchanged (``check_part``); a missing or damaged part is rewritten. A crash
anywhere leaves either nothing visible, or a complete part file that the rerun rewrites under the
same name (rename replaces it atomically). A visible part file is never partial.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.store.layout import OutputDir

PARQUET_MAGIC = b"PAR1"


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def write_json_atomic(path: str, obj, tmp_dir: str | None = None) -> None:
    """Temp file, fsync, rename, fsync the directory. The temp file never outlives a failure."""
    tmp_dir = tmp_dir or os.path.dirname(path)
    tmp = os.path.join(tmp_dir, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    fsync_path(os.path.dirname(path))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Written:
    tmp: str
    size: int
    sha256: str


def write_part(out: OutputDir, task_id: int, unit: int, table: pa.Table) -> Written:
    """Write the part file to this task's temp dir, fsync it and checksum the written bytes."""
    tmp = os.path.join(out.tmp(task_id), f"part-{unit:06d}.parquet.tmp")
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd")
            f.flush()
            os.fsync(f.fileno())
        return Written(tmp, os.path.getsize(tmp), sha256_file(tmp))
    except BaseException:
        _remove_quietly(tmp)
        raise


def publish_part(out: OutputDir, unit: int, tmp: str) -> str:
    """Rename the finished temp file into the dataset (atomic on one filesystem)."""
    final = out.part(unit)
    os.replace(tmp, final)
    fsync_path(out.path)
    return final


def record_commit(out: OutputDir, unit: int, info: dict) -> None:
    write_json_atomic(out.commit_marker(unit), {"unit": unit, **info})


def part_record(out: OutputDir, unit: int, written: Written, fingerprint: str) -> dict:
    """What a commit marker records about its published part file."""
    st = os.stat(out.part(unit))
    return {"part": os.path.basename(out.part(unit)), "size": written.size, "sha256": written.sha256,
            "mtime_ns": st.st_mtime_ns, "fingerprint": fingerprint}


@dataclass
class Commits:
    valid: dict[int, dict] = field(default_factory=dict)  # unit -> marker
    damaged: dict[int, str] = field(default_factory=dict)  # unit -> why the marker is unusable


def read_commits(out: OutputDir) -> Commits:
    """Every commit marker; unreadable ones (a damaged disk, an edit) are listed as damaged."""
    got = Commits()
    if not os.path.isdir(out.commits):
        return got
    for name in os.listdir(out.commits):
        if not (name.startswith("unit-") and name.endswith(".json")):
            continue
        try:
            unit = int(name[5:-5])
        except ValueError:
            continue
        try:
            with open(os.path.join(out.commits, name)) as f:
                marker = json.load(f)
            if not isinstance(marker, dict) or not isinstance(marker.get("rows"), int):
                raise ValueError("not a commit marker")
            got.valid[unit] = marker
        except (OSError, ValueError) as e:
            got.damaged[unit] = f"commit marker {name} is unreadable ({e})"
    return got


def uncommitted_parts(out: OutputDir, total_units: int, commits: Commits) -> list[int]:
    """Units of the plan whose part file is visible but has no marker (a run stopped between
    publishing and committing; the next run rewrites it). Other files in output.path are not ours."""
    return [u for u in range(total_units) if u not in commits.valid and os.path.lexists(out.part(u))]


def committed_units(out: OutputDir) -> dict[int, dict]:
    """{unit: marker} for every readable commit marker (unverified: see check_part)."""
    return read_commits(out).valid


def check_part(out: OutputDir, unit: int, marker: dict, fingerprint: str | None = None,
               full: bool = False) -> str | None:
    """Why the unit's part file cannot be trusted, or None if it is the one its marker describes.

    Cheap by default: the file exists, is a regular file (not a link), has the recorded size and
    ends in the Parquet magic; the sha256 is recomputed only when the mtime moved (or ``full``).
    """
    path = out.part(unit)
    name = os.path.basename(path)
    if fingerprint is not None and marker.get("fingerprint") not in (None, fingerprint):
        return f"{name}: its commit marker belongs to another job"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file"
    size = marker.get("size")
    if size is not None and st.st_size != size:
        return f"{name} has {st.st_size} bytes, its commit recorded {size}"
    try:
        with open(path, "rb") as f:
            if st.st_size < 12:
                return f"{name} is truncated ({st.st_size} bytes)"
            f.seek(-4, os.SEEK_END)
            if f.read(4) != PARQUET_MAGIC:
                return f"{name} is not a whole Parquet file (no footer)"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    digest = marker.get("sha256")
    if digest and (full or st.st_mtime_ns != marker.get("mtime_ns")):
        if sha256_file(path) != digest:
            return f"{name} was modified after it was committed (sha256 differs)"
    return None
