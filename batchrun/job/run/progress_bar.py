"""Progress of a running task: a tqdm bar on a terminal, newline-terminated log lines elsewhere.

``log`` mode is for Slurm and cron logs (``_batchrun/slurm/%A_%a.out``): one line every
``interval`` seconds with rows (output rows: one per sample with sampling.n > 1), error rows, output tok/s (over the interval and overall), ETA,
the current shard and graph set, and units committed; ``verbose`` adds one line per committed
unit. ``auto`` picks ``bar`` when stderr is a terminal, ``log`` otherwise.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

MODES = ("auto", "bar", "log", "none")


def _hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Counts the whole job: ``total_rows``/``total_units`` are the job's, ``done_rows``/``done_units``
    the part committed before this run started (a resumed run starts at its real percentage);
    rates and the ETA use only this run's rows."""

    def __init__(self, mode: str, task: str, total_rows: int, total_units: int, log: Callable[[str], None],
                 interval: float = 30.0, verbose: bool = False, clock=time.time, done_rows: int = 0,
                 done_units: int = 0):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode, self.task, self.log, self.interval, self.verbose = mode, task, log, interval, verbose
        self.total_rows, self.total_units = total_rows, total_units
        self.done_rows, self.done_units = done_rows, done_units
        self.clock = clock
        self.rows = self.errors = self.tokens = self.units = 0
        self.shard = "-"
        self.start = self.last_t = clock()
        self.last_tokens = 0
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total_rows, initial=done_rows, unit="row", dynamic_ncols=True, mininterval=0.5,
                            desc=task)

    def set_shard(self, adapter: str | None) -> None:
        self.shard = adapter or "base"

    @property
    def graph_set(self) -> str:
        return "base" if self.shard == "base" else "lora"

    def row(self, output_tokens: int, error: bool) -> None:
        self.rows += 1
        self.tokens += output_tokens
        self.errors += error
        now = self.clock()
        if self.bar is not None:
            self.bar.update(1)
            rate = self.tokens / max(now - self.start, 1e-9)
            self.bar.set_postfix_str(f"shard={self.shard} out_tok/s={rate:.0f}", refresh=False)
        elif self.mode == "log" and now - self.last_t >= self.interval:
            self._line(now)

    def unit(self, index: int, rows: int, errors: int) -> None:
        self.units += 1
        if self.mode == "log" and self.verbose:
            self.log(f"{self._stamp()} {self.task}: committed unit {index} ({rows} rows, {errors} error rows, "
                     f"shard {self.shard}); {self.done_units + self.units}/{self.total_units} units")

    def _stamp(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.clock()))

    def _line(self, now: float) -> None:
        dt = max(now - self.last_t, 1e-9)
        overall = self.tokens / max(now - self.start, 1e-9)
        recent = (self.tokens - self.last_tokens) / dt
        row_rate = self.rows / max(now - self.start, 1e-9)
        done = self.done_rows + self.rows
        eta = _hms((self.total_rows - done) / row_rate) if row_rate > 0 else "?"
        pct = 100.0 * done / max(self.total_rows, 1)
        self.log(f"{self._stamp()} {self.task}: rows {done}/{self.total_rows} ({pct:.1f}%), "
                 f"{self.errors} error rows, out tok/s {recent:.0f} (last {dt:.1f}s) {overall:.0f} (overall), "
                 f"ETA {eta}, shard {self.shard} (graphs: {self.graph_set}), "
                 f"units {self.done_units + self.units}/{self.total_units} committed")
        self.last_t, self.last_tokens = now, self.tokens

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.mode == "log" and self.rows and self.last_t != self.clock():
            self._line(self.clock())


def row_counts(st) -> str:
    """The rows of the units this run committed: '12 (1 error rows)', or with sampling.n > 1
    '12 input -> 36 output (3 error rows)' (error rows are output rows, one per sample, so they are
    only comparable with the output count). Rows that finished in units that were not committed
    (an interrupt or failure stopped the unit; a unit another worker took over) are not in the
    output: ``discarded`` names them apart."""
    rows, out = st.committed_rows, st.committed_output_rows
    text = (f"{rows} ({st.error_rows} error rows)" if out == rows else
            f"{rows} input -> {out} output ({st.error_rows} error rows)")
    return text


def discarded(st) -> str:
    """'; N finished output row(s) discarded ...' when rows finished in units this run did not commit."""
    lost = st.output_rows - st.committed_output_rows
    return (f"; {lost} finished output row(s) discarded with their uncommitted units (a rerun runs them again)"
            if lost > 0 else "")


def summary_lines(st, exit_code: int, what: str) -> list[str]:
    """The end-of-task block (every line starts with "batchrun: summary", for grep)."""
    gen, tok_s = st.generation_s, st.output_tok_per_s
    head = "batchrun: summary"
    lines = [f"{head} task {st.task_id}/{st.num_tasks}: exit {exit_code} ({what})",
             f"{head} rows {row_counts(st)}; units {st.units_done} written, "
             f"{st.units_skipped} already done, {st.units_repaired} rewritten (damaged), of {st.units_total}"
             + discarded(st),
             f"{head} tokens {st.prompt_tokens} prompt, {st.output_tokens} output; {tok_s:.0f} output tok/s "
             "during generation"]
    reasons = sorted(st.error_reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    for reason, n in reasons[:5]:
        lines.append(f"{head} error rows {n}x: {reason}")
    if len(reasons) > 5:
        lines.append(f"{head} error rows {sum(n for _, n in reasons[5:])}x: {len(reasons) - 5} other reason(s)")
    lines.append(f"{head} time {st.elapsed_s:.1f}s: start-up {st.startup_s:.1f}s (checks and plan {st.prepare_s:.1f}s, "
                 f"waiting for imports {st.import_wait_s:.1f}s, model load {st.model_load_s:.1f}s), "
                 f"generation {gen:.1f}s, writing {st.writing_s:.1f}s")
    return lines
