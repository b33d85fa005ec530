"""Read and tokenize the next work units on a background thread, ahead of the GPU.

``Feeder`` walks an iterable of units lazily, in order (it never calls ``len()`` or indexes it,
so the units may come from a lazy claim iterator), and turns each into a ``UnitWork`` with
``build(unit)`` (read rows, pin checks, tokenize, build requests). It stays at most
``ahead_rows`` rows ahead of the consumer (plus the unit being built). An error in ``build`` or
in the iterable is queued after the units built before it, so the consumer meets it in order and
``get`` re-raises the same exception object (type and message unchanged) on the consumer's
thread.

``UnitSource`` is the engine's side (``engine/source.py``): it takes units from the feeder on
the engine thread, hands each to ``on_unit`` (the runner registers it and re-checks its pins),
and gives their requests to the engine a few at a time; a feeder error ends it (see there).
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterable

from batchrun.engine.request import Request
from batchrun.job.plan.units import Unit
from batchrun.job.inputs.rows import UnitWork

_END = END = object()  # Feeder.get: the units have ended
_POLL_S = 0.1  # a waiting consumer re-checks `poll` (e.g. the writer's health) this often


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Feeder:
    def __init__(self, units: Iterable[Unit], build: Callable[[Unit], UnitWork], ahead_rows: int,
                 name: str = "batchrun-feeder"):
        self._units, self._build = units, build
        self.ahead_rows = max(int(ahead_rows), 1)
        self._queue: deque = deque()
        self._queued_rows = 0
        self._cond = threading.Condition()
        self._stop = False
        self.units_built = 0
        self.error: BaseException | None = None  # what the thread raised (get re-raises it)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> "Feeder":
        self._thread.start()
        return self

    # ---- background thread ------------------------------------------------------------------

    def _main(self) -> None:
        try:
            for unit in self._units:
                if self._stop:
                    return
                if unit is None:  # claims.UnitClaims: every unit left is held by a live worker
                    continue
                with self._cond:
                    while self._queued_rows >= self.ahead_rows and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                work = self._build(unit)
                with self._cond:
                    self._queue.append(work)
                    self._queued_rows += work.unit.rows
                    self.units_built += 1
                    self._cond.notify_all()
            self._put(_END)
        except BaseException as e:  # the consumer raises it, in order
            self.error = e
            self._put(_Failed(e))

    def _put(self, item) -> None:
        with self._cond:
            self._queue.append(item)
            self._cond.notify_all()

    # ---- consumer ---------------------------------------------------------------------------

    def get(self, wait: bool, poll: Callable[[], None] | None = None):
        """The next built unit; None if none is ready yet (wait=False); END once the units ended.

        Raises what the feeder thread raised. ``poll`` runs while waiting (and may raise)."""
        with self._cond:
            while True:
                if self._queue:
                    break
                if not wait:
                    return None
                if poll is not None:
                    self._cond.release()
                    try:
                        poll()
                    finally:
                        self._cond.acquire()
                    if self._queue:
                        continue
                self._cond.wait(_POLL_S)
            item = self._queue[0]
            if item is _END:
                return END
            if isinstance(item, _Failed):
                raise item.error
            self._queue.popleft()
            self._queued_rows -= item.unit.rows
            self._cond.notify_all()
            return item

    def close(self) -> None:
        """Stop reading ahead and wait for the thread (it finishes the unit it is building)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


class UnitSource:
    """The engine's RequestSource over a Feeder: units are registered as their requests go out.

    An error of the feeder (reading, pins, building) or of ``on_unit`` ends the source instead
    of stopping the engine at once: the engine finishes the units already handed to it (so they
    commit, as every unit before the failing one does), and the caller raises ``error`` after.
    Errors of ``poll`` (the writer's) raise at once.
    """

    def __init__(self, feeder: Feeder, on_unit: Callable[[UnitWork], None],
                 poll: Callable[[], None] | None = None):
        self.feeder, self.on_unit, self.poll = feeder, on_unit, poll
        self._buf: deque[Request] = deque()
        self.ended = False
        self.error: BaseException | None = None

    def get(self, wait: bool):
        """The feeder's next unit, not yet registered (None: not ready; END: no more units)."""
        if self.ended:
            return END
        try:
            work = self.feeder.get(wait, self.poll)
        except Exception as e:
            if e is not self.feeder.error:
                raise  # the poll's error, or a bug here: not the end of the units
            self.error, self.ended = e, True
            return END
        if work is END:
            self.ended = True
        return work

    def register(self, work: UnitWork) -> bool:
        """Hand a unit to on_unit; False (and the source ends) if that fails."""
        try:
            self.on_unit(work)
            return True
        except Exception as e:
            self.error, self.ended = e, True
            return False

    def take(self, n: int, wait: bool) -> list[Request] | None:
        if self.poll is not None:
            self.poll()
        while len(self._buf) < n and not self.ended:
            work = self.get(wait=wait and not self._buf)
            if work is None or work is END:
                break
            if self.register(work):
                self._buf.extend(work.requests)
        if not self._buf:
            return None if self.ended else []
        return [self._buf.popleft() for _ in range(min(n, len(self._buf)))]
