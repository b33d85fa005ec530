"""SIGTERM/SIGINT, from the first moment of the process to its last: exit 130 with one line.

Two phases. The console entry (batchrun/__main__.py) installs the **start-up** handler before
importing anything heavy (click, pyarrow, torch): until the command first writes a file or starts a
child (``start_up_over``), nothing needs cleaning up, so a signal prints the one line and leaves at
once with ``os._exit(130)``. Raising an exception there instead is unsafe: the handler runs at an
arbitrary bytecode, and during start-up that is mostly inside the import machinery, on two threads
(`batchrun run` imports torch on its preload thread). An exception raised inside importlib's
module-lock weakref callback is *swallowed* ("Exception ignored in ...") after the callback took
the global import lock and before its ``try``: the signal is lost, the lock stays held, the preload
thread blocks on its next import and the main thread then waits for it forever (the intermittent
CI hang of test_signal_during_start_up_exits_130_with_one_line).

From ``start_up_over`` on, signals raise ``Interrupted`` so finally blocks run (temp files removed,
claims given back). The runner narrows this inside a commit: the signal is deferred until the
commit ends (``Signals.deferred``), so a part file and its marker are never split by a Ctrl-C; and
a signal whose exception was swallowed is raised again at the next result (``Signals.check``).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODE = 130  # ExitCode.INTERRUPTED (exit_codes.py; not imported: this module loads first)


class Interrupted(BaseException):
    """SIGTERM/SIGINT. BaseException so no ``except Exception`` (nor click's KeyboardInterrupt
    handler, which would print "Aborted!" and exit 1) swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def message(name: str) -> str:
    """The console's one line for a signal that ended the process (``name``: SIGTERM/SIGINT)."""
    return (f"batchrun: error: interrupted ({name}); no partial file was left. Rerun the same "
            "command (a run resumes after its committed units).\n")


def _raise(signum, frame):
    raise Interrupted(signum)


def _exit_now(signum, frame):
    """Start-up: nothing written yet, so nothing to clean up; leave without unwinding (see above)."""
    try:
        sys.stderr.flush()  # earlier log lines first (it fails only if the signal cut a write)
    except BaseException:
        pass
    os.write(2, message(signal.Signals(signum).name).encode())
    os._exit(EXIT_CODE)


_start_up = False  # the start-up handler is in place (the console entry, until start_up_over)


def install_early() -> None:
    """The console entry's first step: the start-up handler (exit at once, see above)."""
    global _start_up
    for s in SIGNALS:
        signal.signal(s, _exit_now)
    _start_up = True


def in_start_up() -> bool:
    return _start_up


def start_up_over() -> None:
    """Call before the command first writes a file or starts a child process: from here on a
    signal raises Interrupted, so cleanup runs. Nothing happens unless the console entry's
    start-up handler is in place (the Python API and in-process tests keep their own handlers),
    and nothing off the main thread (only it may set handlers)."""
    global _start_up
    if not _start_up or threading.current_thread() is not threading.main_thread():
        return
    _start_up = False
    for s in SIGNALS:
        if signal.getsignal(s) is _exit_now:
            signal.signal(s, _raise)


class Signals:
    """Raise Interrupted on SIGTERM/SIGINT, except inside ``deferred()`` (raised when it ends)."""

    def __init__(self):
        self.critical = False
        self.pending: int | None = None
        self.raised: int | None = None  # the last signal raised as Interrupted (see check)
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
            self.raised = signum
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise Interrupted again if a signal was raised and we are still running: its first
        exception landed where Python swallows exceptions (a __del__ or weakref callback)."""
        if self.raised is not None:
            raise Interrupted(self.raised)

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
