"""SIGTERM/SIGINT -> Interrupted, from the first moment of the process to its last.

The console entry (batchrun/__main__.py) installs these handlers before importing anything heavy
(click, pyarrow, torch), so a signal during start-up exits 130 with one line, like one during the
run. The runner narrows this inside a commit: the signal is deferred until the commit ends
(``Signals.deferred``), so a part file and its marker are never split by a Ctrl-C.
"""
from __future__ import annotations

import signal
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """SIGTERM/SIGINT. BaseException so no ``except Exception`` (nor click's KeyboardInterrupt
    handler, which would print "Aborted!" and exit 1) swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum, frame):
    raise Interrupted(signum)


def install_early() -> None:
    for s in SIGNALS:
        signal.signal(s, _raise)


class Signals:
    """Raise Interrupted on SIGTERM/SIGINT, except inside ``deferred()`` (raised when it ends)."""

    def __init__(self):
        self.critical = False
        self.pending: int | None = None
        self._old = {}

    def install(self):
        for s in SIGNALS:
            self._old[s] = signal.signal(s, self._handle)

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _handle(self, signum, frame):
        if self.critical:
            self.pending = signum
        else:
            raise Interrupted(signum)

    @contextmanager
    def deferred(self):
        self.critical = True
        try:
            yield
        finally:
            self.critical = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise Interrupted(signum)
