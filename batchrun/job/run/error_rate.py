"""`max_error_rate` (job file) / `batchrun run --max-error-rate R`: when a finished job counts as
failed because too many of its rows are error rows (exit 10, ExitCode.ERROR_RATE).

The rule, over the WHOLE output (every committed unit, whichever run or worker wrote it):

- ``R`` set (0 <= R <= 1): failed when error rows / output rows > R. ``0`` fails on any error
  row, ``1`` never fails.
- unset (the default): failed only when every output row is an error row (a bad per-row
  response_format on every row, an adapter the job does not configure for all rows...). A job
  where nothing ran is not a success, whatever on_error says.

It is judged once the job is complete: a worker that finishes while other workers' units are
still pending exits as usual (the last worker judges the whole). A resumed run with nothing left
to do judges the same output again, so a rerun never turns a failed job into a success. The
committed units are kept either way; the check only decides the exit code.
"""
from __future__ import annotations

from batchrun.common.short_repr import short_repr


class ErrorRateExceeded(Exception):
    """The complete job's error rows exceed max_error_rate; the output is kept."""


def check_rate(value, where: str) -> float | None:
    """A max_error_rate value from the job file or the command line: None, or a float in [0, 1]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{where}: expected a fraction of rows from 0 to 1 (0.05 = 5 %), or null for the "
                         f"default (fail only if every row failed), got {short_repr(value)}")
    return float(value)


def error_rate_problem(error_rows: int, output_rows: int, limit: float | None) -> str | None:
    """Why a complete job of ``output_rows`` rows (``error_rows`` of them error rows) failed, or None."""
    if output_rows <= 0 or error_rows <= 0:
        return None
    rate = error_rows / output_rows
    if limit is None:
        if error_rows < output_rows:
            return None
        return (f"every row of the job is an error row ({error_rows} of {output_rows}); the output is kept. "
                "See the summary's error reasons (or `batchrun show`), fix the job or its rows and rerun "
                "with --restart; set max_error_rate: 1 to accept such a job")
    if rate <= limit:
        return None
    return (f"{error_rows} of {output_rows} output rows are error rows ({100 * rate:.2f} %), more than "
            f"max_error_rate {limit:g} ({100 * limit:.2f} %); the output is kept. See the summary's error "
            "reasons (or `batchrun show`); raise max_error_rate to accept it")


def check_job(job: dict, limit: float | None) -> None:
    """Raise ErrorRateExceeded when the complete job (``metrics.job_metrics``) fails the rule."""
    if not job["complete"]:
        return
    problem = error_rate_problem(job["error_rows"], job["output_rows_committed"], limit)
    if problem is not None:
        raise ErrorRateExceeded(problem)
