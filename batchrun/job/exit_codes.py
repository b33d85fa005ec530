"""Exit codes (README "Exit codes", `batchrun --help`) and which failure maps to which.

``ExitCode`` is the one list: README's table and the --help text are checked against it
(tests/runner/test_exit_code_docs.py). Codes 9 and 10 are the ones a script acts on after a run
that did not crash: 9 = not finished yet (`verify`/`status`), 10 = finished, but too many rows
failed to trust the output (`run`).
"""
from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0  # done (rows that could not run are error rows in the output, counted in the summary)
    INTERNAL = 1  # a bug or an unexpected failure (traceback printed); committed units are kept
    USAGE = 2  # bad command line (click)
    CONFIG = 3  # bad job file, input, model, adapter or output dir: nothing was run
    ROW_ERROR = 4  # on_error: fail and a row could not run; committed units are kept
    JOB_CHANGED = 5  # output dir holds a different job, or an input changed mid-run
    LOCKED = 6  # another run of this task (or a run being restarted) holds the output dir's lock
    OUTPUT_IO = 7  # the output dir (or an object store) cannot be written/read (disk full, read-only,
    # permissions, no bucket, refused credentials); committed units are kept
    DAMAGED = 8  # `verify` found missing/damaged part files; rerun the job to rewrite them
    PENDING = 9  # `verify`/`status`: some units are not committed yet (the output is incomplete)
    ERROR_RATE = 10  # `run`: the job's error rows exceed max_error_rate (error_rate.py); kept
    INTERRUPTED = 130  # SIGINT/SIGTERM: stopped between units, no partial file; rerun to resume


# code -> its meaning as `batchrun --help` prints it (README's table says the same, at more length)
MEANINGS = {
    ExitCode.OK: "done (rows that could not run are error rows, counted in the summary)",
    ExitCode.INTERNAL: "internal error (traceback printed); committed units kept",
    ExitCode.USAGE: "bad command line",
    ExitCode.CONFIG: "bad job file, input, model, adapter or output dir; nothing ran",
    ExitCode.ROW_ERROR: "on_error: fail and a row could not run",
    ExitCode.JOB_CHANGED: "output dir holds a different job, or an input changed mid-run",
    ExitCode.LOCKED: "another run of this task holds the output dir's lock",
    ExitCode.OUTPUT_IO: "output dir or object store not writable/readable (disk full, read-only, no bucket, access denied)",
    ExitCode.DAMAGED: "verify/status found missing or damaged part files",
    ExitCode.PENDING: "verify/status: units still pending (output incomplete)",
    ExitCode.ERROR_RATE: ("run: the job's error rows exceed max_error_rate (default: every row "
                          "failed); committed units kept"),
    ExitCode.INTERRUPTED: "interrupted (SIGINT/SIGTERM); rerun to resume",
}

# \b keeps click from rewrapping the paragraph: one code per line, as README's table has them
HELP = "\b\nExit codes:\n" + "\n".join(f"  {int(c):>3}  {MEANINGS[c]}" for c in ExitCode)


def exit_code_of(exc: BaseException | None) -> ExitCode:
    """The exit code `batchrun run` gives for a run that ended with ``exc`` (None: success)."""
    from batchrun.errors import ConfigError, JobChanged, OutputIOError
    from batchrun.job.run.error_rate import ErrorRateExceeded
    from batchrun.job.run.interrupt import Interrupted
    from batchrun.job.store.lock import LockBusy
    from batchrun.job.run.runner import RowFailure
    if exc is None:
        return ExitCode.OK
    for types, code in ((JobChanged, ExitCode.JOB_CHANGED), (ConfigError, ExitCode.CONFIG),
                        (LockBusy, ExitCode.LOCKED), (RowFailure, ExitCode.ROW_ERROR),
                        (ErrorRateExceeded, ExitCode.ERROR_RATE), (OutputIOError, ExitCode.OUTPUT_IO),
                        ((Interrupted, KeyboardInterrupt), ExitCode.INTERRUPTED)):
        if isinstance(exc, types):
            return code
    if isinstance(exc, OSError) and exc.filename is not None:
        return ExitCode.OUTPUT_IO
    return ExitCode.INTERNAL
