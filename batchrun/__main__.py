"""Console entry (`batchrun ...`, `python -m batchrun ...`).

Signal handlers come first, before click/pyarrow/torch are imported, so SIGTERM/SIGINT at any
moment of start-up exits 130 with one line instead of 143 (no message) or click's "Aborted!"
(job/run/interrupt.py: at once while nothing is written, then as Interrupted).
"""
import os
import sys

from batchrun.job.run.interrupt import EXIT_CODE as INTERRUPTED, Interrupted, install_early, message


def entry(args=None) -> None:
    install_early()
    try:
        from batchrun.cli import main
        main(args)
        code = 0
    except Interrupted as e:
        sys.stderr.write(message(str(e)))
        code = INTERRUPTED
    except SystemExit as e:
        code = e.code
    _exit(code)


def _exit(code) -> None:
    """Exit with `code`. If the preload thread is still importing (a signal or a failed check
    came first), leave at once: interpreter shutdown can block forever on the import lock that
    thread holds (seen as a run that ignored SIGTERM during start-up). Everything this process
    writes is already on disk or flushed here, and its locks are released by the OS."""
    from batchrun.common import preload
    if preload.busy():
        if code is not None and not isinstance(code, int):
            sys.stderr.write(f"{code}\n")
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)


if __name__ == "__main__":
    entry()
