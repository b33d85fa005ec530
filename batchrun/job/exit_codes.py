"""Exit codes (README "Exit codes", `batchrun --help`) and which failure maps to which."""
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
    OUTPUT_IO = 7  # the output dir cannot be written/read (disk full, read-only, permissions); kept
    DAMAGED = 8  # `verify` found missing/damaged part files; rerun the job to rewrite them
    INTERRUPTED = 130  # SIGINT/SIGTERM: stopped between units, no partial file; rerun to resume


HELP = """Exit codes: 0 done (bad rows are error rows); 1 internal error (traceback; committed units
kept); 2 bad command line; 3 bad job file/input/model/adapter/output dir (nothing ran); 4 on_error:
fail and a row failed; 5 output dir holds a different job, or an input changed mid-run; 6 another
run of this task is running; 7 output dir not writable/readable (disk full, read-only); 8 verify
found damaged parts; 130 interrupted (SIGINT/SIGTERM), rerun to resume."""


def exit_code_of(exc: BaseException | None) -> ExitCode:
    """The exit code `batchrun run` gives for a run that ended with ``exc`` (None: success)."""
    from batchrun.errors import ConfigError, JobChanged, OutputIOError
    from batchrun.job.interrupt import Interrupted
    from batchrun.job.lock import LockBusy
    from batchrun.job.runner import RowFailure
    if exc is None:
        return ExitCode.OK
    for types, code in ((JobChanged, ExitCode.JOB_CHANGED), (ConfigError, ExitCode.CONFIG),
                        (LockBusy, ExitCode.LOCKED), (RowFailure, ExitCode.ROW_ERROR),
                        (OutputIOError, ExitCode.OUTPUT_IO),
                        ((Interrupted, KeyboardInterrupt), ExitCode.INTERRUPTED)):
        if isinstance(exc, types):
            return code
    if isinstance(exc, OSError) and exc.filename is not None:
        return ExitCode.OUTPUT_IO
    return ExitCode.INTERNAL
