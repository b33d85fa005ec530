"""Write, publish and commit finished work units on a background thread, off the GPU thread.

The engine thread hands each finished unit to ``put``; the writer thread runs ``commit(work)``
(the runner's ``_finish``: write the part file, publish it, write its marker) one unit at a time,
in hand-off order. At most ``max_queued`` units wait; a full queue blocks ``put`` (the time the
engine thread spends blocked is ``wait_s``). Signals are handled on the main thread only, so a
commit on this thread is never cut by SIGTERM/SIGINT; ``close`` waits for what was handed over.

The first error of a commit stops the writer (the units after it stay uncommitted); ``check``,
``put`` and ``close`` re-raise that same exception object, type and message unchanged, on the
caller's thread.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from batchrun.job.inputs.rows import UnitWork

_POLL_S = 0.1


class Writer:
    def __init__(self, commit: Callable[[UnitWork], None], max_queued: int = 4, name: str = "batchrun-writer"):
        self._commit = commit
        self.max_queued = max(int(max_queued), 1)
        self._queue: deque[UnitWork] = deque()
        self._busy = False
        self._cond = threading.Condition()
        self._closing = False
        self.error: BaseException | None = None
        self.wait_s = 0.0  # time callers spent blocked on the writer (full queue, close)
        self.units_written = 0
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> "Writer":
        self._thread.start()
        return self

    def _main(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return  # closing and drained
                work = self._queue.popleft()
                self._busy = True
                self._cond.notify_all()
            try:
                self._commit(work)
            except BaseException as e:
                with self._cond:
                    self.error = e
                    self._busy = False
                    self._queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy = False
                self.units_written += 1
                self._cond.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    @property
    def backlog(self) -> int:
        """Units handed over and not yet committed (queued or being written)."""
        with self._cond:
            return len(self._queue) + self._busy

    def put(self, work: UnitWork) -> None:
        t0 = time.time()
        with self._cond:
            while len(self._queue) >= self.max_queued and self.error is None:
                self._cond.wait(_POLL_S)
            self.check()
            self._queue.append(work)
            self._cond.notify_all()
        self.wait_s += time.time() - t0

    def close(self) -> None:
        """Commit everything handed over, then stop the thread. Re-raises the writer's error."""
        t0 = time.time()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        self.wait_s += time.time() - t0
        self.check()
