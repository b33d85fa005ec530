"""Input files pinned to the plan: a run stops (exit 5) if one changes under it.

The plan records each input file's identity (size, mtime_ns, content digest). prepare() pins the
files as they are when the run starts, after the fingerprint has proved their content is the
planned one; the runner re-checks a unit's files before and after reading its rows. A stat is
enough while size and mtime hold; a moved mtime with the same size costs one digest (a ``touch``
or a copy with the same bytes is not a change).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from batchrun.job.store.fingerprint import file_digest
from batchrun.errors import InputChanged


@dataclass
class Pin:
    size: int
    mtime_ns: int
    digest: str


def identity(path: str) -> Pin:
    """(size, mtime_ns, digest) of a file that is not being written while we read it."""
    for _ in range(3):
        before = os.stat(path)
        digest = file_digest(path)
        after = os.stat(path)
        if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns):
            return Pin(after.st_size, after.st_mtime_ns, digest)
    raise InputChanged(f"input file {path} keeps changing while batchrun reads it; wait until it is "
                       "written completely, then rerun")


class InputPins:
    def __init__(self, files: list[str], pins: list[Pin]):
        self.files, self.pins = files, pins

    def check(self, file_indices) -> None:
        """Re-check each distinct file of a unit (``file_indices``: the unit's row_file array)."""
        for fi in np.unique(file_indices):
            self._check(int(fi))

    def _check(self, fi: int) -> None:
        path, pin = self.files[fi], self.pins[fi]
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

    @staticmethod
    def _message(path: str, what: str) -> str:
        return (f"input file {path} changed during the run ({what}). The run stopped; the units committed "
                "so far came from the old file and are kept. Put the old file back and rerun to finish, or "
                "rerun with --restart to start over with the new contents")
