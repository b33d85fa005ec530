"""Input files pinned to the plan: a run stops (exit 5) if one changes under it.

The plan records each input file's identity (size, mtime_ns, content digest). prepare() pins the
files as they are when the run starts, after the fingerprint has proved their content is the
planned one; the runner re-checks a unit's files before and after reading its rows. A stat is
enough while size and mtime hold; a moved mtime with the same size costs one digest (a ``touch``
or a copy with the same bytes is not a change).

An object in a store (s3://, gs://) is pinned by size and version instead (one metadata request,
no download): its ETag on S3, its generation on GCS. The store gives a new one to every new
upload, so a replaced object is always noticed; an upload of the same bytes (on S3 in other
multipart sizes) also gets a new one and counts as a change.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from batchrun.job.store.fingerprint import file_digest
from batchrun.errors import InputChanged
from batchrun.job.storage.options import StorageOptions
from batchrun.job.storage.registry import storage_for
from batchrun.job.storage.uri import is_uri


@dataclass
class Pin:
    size: int
    mtime_ns: int  # 0 for an object (its ETag is in digest)
    digest: str


ETAG = "etag:"  # an object's digest: its ETag as the store sends it


def object_identity(path: str, options: StorageOptions | None = None) -> Pin:
    info = storage_for(path, options).stat(path)
    if info is None:
        raise InputChanged(f"input file {path} disappeared while batchrun read the input; rerun once the input "
                           "is complete")
    return Pin(info.size, 0, ETAG + info.version)


def identity(path: str, options: StorageOptions | None = None) -> Pin:
    """(size, mtime_ns, digest) of a file that is not being written while we read it
    (``options``: input.storage_options, for an object)."""
    if is_uri(path):
        return object_identity(path, options)
    for _ in range(3):
        before = os.stat(path)
        digest = file_digest(path)
        after = os.stat(path)
        if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns):
            return Pin(after.st_size, after.st_mtime_ns, digest)
    raise InputChanged(f"input file {path} keeps changing while batchrun reads it; wait until it is "
                       "written completely, then rerun")


class InputPins:
    def __init__(self, files: list[str], pins: list[Pin], options: StorageOptions | None = None):
        self.files, self.pins, self.options = files, pins, options

    def check(self, file_indices) -> None:
        """Re-check each distinct file of a unit (``file_indices``: the unit's row_file array)."""
        for fi in np.unique(file_indices):
            self._check(int(fi))

    def _check(self, fi: int) -> None:
        path, pin = self.files[fi], self.pins[fi]
        if is_uri(path):
            self._check_object(path, pin)
            return
        try:
            st = os.stat(path)
        except OSError as e:
            raise InputChanged(self._message(path, f"it can no longer be read ({e.strerror}: deleted or moved?)")) from None
        if (st.st_size, st.st_mtime_ns) == (pin.size, pin.mtime_ns):
            return
        if st.st_size != pin.size:
            raise InputChanged(self._message(path, f"its size went from {pin.size} to {st.st_size} bytes"))
        if file_digest(path) != pin.digest:
            raise InputChanged(self._message(path, "its content changed"))
        self.pins[fi] = Pin(st.st_size, st.st_mtime_ns, pin.digest)  # touched, same bytes

    def _check_object(self, path: str, pin: Pin) -> None:
        info = storage_for(path, self.options).stat(path)
        if info is None:
            raise InputChanged(self._message(path, "it can no longer be read (deleted or moved?)"))
        if info.size != pin.size:
            raise InputChanged(self._message(path, f"its size went from {pin.size} to {info.size} bytes"))
        if ETAG + info.version != pin.digest:
            raise InputChanged(self._message(path, f"it was replaced: its ETag went from {pin.digest[len(ETAG):]} "
                                                   f"to {info.version}"))

    @staticmethod
    def _message(path: str, what: str) -> str:
        return (f"input file {path} changed during the run ({what}). The run stopped; the units committed "
                "so far came from the old file and are kept. Put the old file back and rerun to finish, or "
                "rerun with --restart to start over with the new contents")
