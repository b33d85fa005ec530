"""Run one worker of a job: claim uncommitted units (batchrun/claims.py) and run them, base shard
first, then adapters; any number of workers may share one output directory.

Units of one shard are fed to the engine a group at a time (several units per ``generate`` call,
so continuous batching does not drain at every unit boundary); each unit is written and committed
the moment its last row finishes, so a crash loses at most the units still in flight.
"""
from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

import numpy as np

from batchrun import commit
from batchrun.claims import UnitClaims
from batchrun.commit import check_part, read_commits
from batchrun.engine.request import Result
from batchrun.errors import ConfigError, OutputIOError, io_message
from batchrun.interrupt import Interrupted, Signals
from batchrun.inputs import RowReader
from batchrun.job import JobSpec
from batchrun.lock import TaskLock
from batchrun.metrics import write_metrics
from batchrun.output import OutputDir
from batchrun.plan import Unit, assign_tasks, group_rows, iter_engine_groups
from batchrun.progress import Progress
from batchrun.prepare import Prepared, prepare
from batchrun.rows import UnitWork, build_unit, input_columns, unit_table


class RowFailure(Exception):
    """on_error: fail and a row could not run."""


@dataclass
class TaskStats:
    task_id: int
    num_tasks: int
    status: str = "running"  # running | done | interrupted | failed
    units_total: int = 0  # the job's units (any worker may run any of them)
    units_skipped: int = 0  # committed before this run started (by an earlier run or another worker)
    units_done: int = 0  # committed by this run
    units_repaired: int = 0  # committed earlier, but the part file was missing/damaged: rewritten
    units_lost: int = 0  # finished after another worker took over its expired claim: discarded
    units_taken_over: int = 0  # claims of other workers that had expired (dead, killed) and this one took
    worker: str = ""  # lock / temp-dir / metrics name (the task id, plus the Slurm array job id)
    rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    started: float = field(default_factory=time.time)
    elapsed_s: float = 0.0
    model_load_s: float = 0.0
    startup_s: float = 0.0  # from the start of run_job until the engine was ready (checks, plan, load)
    writing_s: float = 0.0  # writing, publishing and committing part files
    error_reasons: dict = field(default_factory=dict)  # reason (digits as N) -> error rows

    @property
    def generation_s(self) -> float:
        """Wall time after start-up (checks, plan, model load), less writing part files."""
        return max(self.elapsed_s - max(self.startup_s, self.model_load_s) - self.writing_s, 0.0)

    @property
    def output_tok_per_s(self) -> float:
        gen = self.generation_s
        return self.output_tokens / gen if gen > 0 else 0.0


def load_engine(spec: JobSpec):
    """The real engine (imported late: planning and validation never need torch)."""
    from batchrun.config import EngineConfig
    from batchrun.engine.engine import Engine
    e = spec.engine
    cfg = EngineConfig(model=spec.model, device=e.device, dtype=e.dtype, max_num_seqs=e.max_num_seqs,
                       max_num_batched_tokens=e.max_num_batched_tokens, max_model_len=e.max_model_len,
                       gpu_memory_utilization=e.gpu_memory_utilization, enable_lora=bool(spec.adapters),
                       max_loras=e.max_loras, max_lora_rank=e.max_lora_rank, enforce_eager=e.enforce_eager,
                       seed=spec.sampling.seed)
    return Engine.from_config(cfg, adapters=dict(spec.adapters))


class TaskRunner:
    def __init__(self, prep: Prepared, task_id: int, num_tasks: int, engine_factory: Callable,
                 progress: bool | str = True, log=print, log_interval: float = 30.0, verbose: bool = False,
                 started: float | None = None, worker: str | None = None, claim_lease: float | None = None):
        self.prep, self.spec, self.out, self.plan = prep, prep.spec, prep.out, prep.plan
        self.task_id, self.num_tasks = task_id, num_tasks
        self.engine_factory = engine_factory
        self.mode = {True: "auto", False: "none"}.get(progress, progress)
        self.log, self.log_interval, self.verbose = log, log_interval, verbose
        self.worker = worker or str(task_id)
        self.claim_lease = claim_lease
        self.claims: UnitClaims | None = None
        self.stats = TaskStats(task_id, num_tasks, worker=self.worker)
        if started is not None:
            self.stats.started = started
        self.signals = Signals()
        self.progress: Progress | None = None

    # ---- commit -----------------------------------------------------------------------------

    def _finish(self, work: UnitWork) -> None:
        table = unit_table(work, self.plan.input_schema.id_type)
        errors = sum(r.finish_reason == "error" for r in work.results)
        info = {"task": self.task_id, "worker": self.worker, "adapter": work.unit.adapter, "rows": work.unit.rows,
                "error_rows": errors,
                "prompt_tokens": sum(r.prompt_tokens for r in work.results),
                "output_tokens": sum(len(r.output_token_ids) for r in work.results),
                "time": time.time()}
        unit = work.unit.index
        t0 = time.time()
        with self.signals.deferred():
            try:
                written = commit.write_part(self.out, self.worker, unit, table)
                if self.claims is not None and not self.claims.still_mine(unit):
                    os.remove(written.tmp)  # our lease expired and another worker took the unit over
                    self.claims.release(unit, committed=False)
                    self.stats.units_lost += 1
                    self.log(f"task {self.task_id}/{self.num_tasks}: unit {unit} was taken over by another "
                             "worker (this worker's claim expired); its result is discarded")
                    return
                commit.publish_part(self.out, unit, written.tmp)
                info.update(commit.part_record(self.out, unit, written, self.prep.fingerprint))
                commit.record_commit(self.out, unit, info)
            except OSError as e:  # disk full, read-only, quota: the unit stays uncommitted
                raise OutputIOError(io_message(e, f"cannot commit unit {unit}")) from None
            if self.claims is not None:
                self.claims.release(unit)
        st = self.stats
        st.writing_s += time.time() - t0
        st.units_done += 1
        st.error_rows += errors
        st.prompt_tokens += info["prompt_tokens"]
        if self.progress is not None:
            self.progress.unit(unit, work.unit.rows, errors)

    def _on_result(self, pending: dict[int, UnitWork]) -> Callable[[Result], None]:
        def on_result(res: Result) -> None:
            unit_index, pos = res.request_id
            work = pending.get(unit_index)
            if work is None or work.results[pos] is not None:
                return
            work.results[pos] = res
            self._row_done(res)
            if res.finish_reason == "error" and self.spec.on_error == "fail":
                raise RowFailure(self._fail_message(work.ids[pos], res.error))
            if work.remaining == 0:
                del pending[unit_index]
                self._finish(work)
        return on_result

    def _row_done(self, res: Result) -> None:
        st = self.stats
        st.rows += 1
        st.output_tokens += len(res.output_token_ids)
        failed = res.finish_reason == "error"
        if failed:
            reason = _DIGITS.sub("N", res.error or "?")[:200]
            st.error_reasons[reason] = st.error_reasons.get(reason, 0) + 1
        if self.progress is not None:
            self.progress.row(len(res.output_token_ids), failed)

    def _fail_message(self, row_id, error: str) -> str:
        return (f"row id={row_id!r}: {error}. The job stopped (on_error: fail); units committed so far are "
                "kept. Fix the row, or set on_error: skip to write it as an error row.")

    # ---- main loop --------------------------------------------------------------------------

    def _verified_commits(self, mine: list[Unit]) -> set[int]:
        """The units whose marker is readable and whose part file is the one it recorded.

        A unit with a missing, truncated or changed part (or an unreadable marker) loses its
        marker here (markers go before parts, as in a restart) and is run again.
        """
        commits = read_commits(self.out)
        done = set()
        for u in mine:
            reason = commits.damaged.get(u.index)
            if reason is None and u.index in commits.valid:
                reason = check_part(self.out, u.index, commits.valid[u.index], self.prep.fingerprint)
                if reason is None:
                    done.add(u.index)
                    continue
            if reason is not None:
                self.log(f"task {self.task_id}: unit {u.index} was committed but {reason}; rewriting it")
                try:
                    os.remove(self.out.commit_marker(u.index))
                except FileNotFoundError:
                    pass
                self.stats.units_repaired += 1
        return done

    def _home(self) -> int:
        """Where this worker starts claiming: its contiguous share for the --num-tasks hint."""
        if not self.plan.units:
            return 0
        tasks = assign_tasks(self.plan, self.num_tasks)
        return int(min(np.searchsorted(tasks, self.task_id), len(tasks) - 1))

    def run(self) -> TaskStats:
        st = self.stats
        units = self.plan.units
        done = self._verified_commits(units)
        todo = [u for u in units if u.index not in done]
        st.units_total, st.units_skipped = len(units), len(done)
        tmp_dir = self.out.tmp(self.worker)
        shutil.rmtree(tmp_dir, ignore_errors=True)  # leftovers of a killed run of this worker
        os.makedirs(tmp_dir, exist_ok=True)
        os.makedirs(self.out.commits, exist_ok=True)
        name = f"task {self.task_id}/{self.num_tasks}"
        try:
            self.signals.install()
            if not todo:
                self.log(f"{name}: nothing to do: all {len(units)} of its units were committed by an earlier run")
                st.status = "done"
                return st
            self.log(f"{name}: {len(todo)} of {len(units)} units to run ({st.units_skipped} already committed), "
                     f"{sum(u.rows for u in todo)} rows; claimed one at a time, shared with any other worker")
            unknown = [u for u in todo if not u.known]
            if unknown and self.spec.on_error == "fail":  # known from the plan: fail before loading weights
                names = sorted({u.adapter for u in unknown})
                raise RowFailure(f"{sum(u.rows for u in unknown)} row(s) name adapters that are not configured "
                                 f"({', '.join(map(repr, names))}; configured: {', '.join(self.spec.adapters) or 'none'}). "
                                 "The job stopped (on_error: fail). Add them under adapters:, or set on_error: skip.")
            self.claims = UnitClaims(self.out, units, self.worker, start=self._home(), done=done,
                                     lease_s=self.claim_lease, log=self.log)
            claimed = iter(self.claims)
            first = next((u for u in claimed if u is not None), None)  # waits while others hold every unit
            if first is None:
                self.log(f"{name}: nothing to do: other workers committed the remaining units")
                st.status = "done"
                return st
            t0 = time.time()
            engine = self.engine_factory(self.spec)
            st.model_load_s = time.time() - t0
            st.startup_s = time.time() - st.started
            self._run_units(engine, _chain(first, claimed), sum(u.rows for u in todo), len(todo))
            st.status = "done"
        except Interrupted:
            st.status = "interrupted"
            raise
        except BaseException:
            st.status = "failed"
            raise
        finally:
            if self.claims is not None:
                self.claims.close()  # gives back the units not committed
                st.units_taken_over = self.claims.stolen
            if self.progress is not None:
                self.progress.close()
            self.signals.restore()
            shutil.rmtree(tmp_dir, ignore_errors=True)
            st.elapsed_s = time.time() - st.started
            self._write_metrics()
        return st

    def _run_units(self, engine, units: Iterable[Unit | None], rows_left: int, units_left: int) -> None:
        """Feed ``units`` (an iterable; ``None`` = flush: see iter_engine_groups) to the engine."""
        spec = self.spec
        reader = RowReader(self.plan.files, input_columns(spec, self.plan))
        cap = group_rows(spec.engine.max_num_seqs)
        max_len = getattr(engine, "max_model_len", spec.engine.max_model_len)
        if self.mode != "none":
            self.progress = Progress(self.mode, f"task {self.task_id}/{self.num_tasks}", rows_left,
                                     units_left, self.log, self.log_interval, self.verbose)
        for group in iter_engine_groups(units, cap, spec.engine.max_loras):
            if self.progress is not None:
                self.progress.set_shard("+".join(dict.fromkeys(u.adapter for u in group if u.adapter)) or None)
            pending: dict[int, UnitWork] = {}
            requests = []
            for unit in group:
                rf, ri = self.plan.unit_rows(unit)
                pins = self.prep.pins
                pins.check(rf)  # before and after: a file replaced mid-read mixes rows
                try:
                    rows = reader.read(rf, ri)
                except Exception:
                    pins.check(rf)  # a file that changed under the reader says so ...
                    raise  # ... anything else is a real failure
                pins.check(rf)
                work = build_unit(unit, rows, rf, ri, self.plan, spec, engine.tokenizer, max_len,
                                  engine.check_request)
                bad = work.first_error()
                if bad and spec.on_error == "fail":
                    raise RowFailure(self._fail_message(*bad))
                for r in work.results:
                    if r is not None:
                        self._row_done(r)
                if work.remaining == 0:
                    self._finish(work)
                else:
                    pending[unit.index] = work
                    requests += work.requests
            if not requests:
                continue
            on_result = self._on_result(pending)
            results = engine.generate(requests, on_result=on_result)
            for res in results:  # rows the engine returned without a callback
                on_result(res)
            if pending:
                missing = sorted(pending)
                raise RuntimeError(f"engine returned no result for some rows of units {missing[:5]}")

    # ---- metrics ----------------------------------------------------------------------------

    def _write_metrics(self) -> None:
        try:
            this_run = {**asdict(self.stats), "output_tok_per_s": self.stats.output_tok_per_s}
            write_metrics(self.out, self.worker, this_run, len(self.plan.units), self.plan.total_rows)
        except OSError as e:  # metrics must never turn a finished run into a failed one
            self.log(f"warning: could not write metrics: {e}")


_DIGITS = re.compile(r"\d+")  # error reasons are counted with their numbers as N


def _chain(first, rest):
    yield first
    yield from rest


def run_job(spec: JobSpec, task_id: int = 0, num_tasks: int = 1, restart: bool = False,
            engine_factory: Callable | None = None, progress: bool | str = True, log=print,
            log_interval: float = 30.0, verbose: bool = False, on_stats: Callable | None = None,
            restart_token: str | None = None, worker: str | None = None,
            claim_lease: float | None = None) -> TaskStats:
    """Validate + plan (no weights), take this task's lock, run its units. Raises on failure.

    ``progress``: auto | bar | log | none (True = auto, False = none). ``on_stats`` receives the
    task's TaskStats as soon as it exists, so a caller can report on a run that then fails.
    ``task_id``/``num_tasks`` only pick where the worker starts claiming; ``worker`` (default: the
    task id) names its lock, temp dir and metrics file, so two arrays' task 0s do not collide.
    """
    if not 0 <= task_id < num_tasks:
        raise ConfigError(f"--task-id must be in [0, {num_tasks}), got {task_id}")
    started = time.time()
    prep = prepare(spec, restart=restart, log=log, restart_token=restart_token)
    worker = worker or str(task_id)
    lock = TaskLock(prep.out.lock(worker), f"task {worker} of {prep.out.path}")
    with lock:
        runner = TaskRunner(prep, task_id, num_tasks, engine_factory or load_engine, progress=progress, log=log,
                            log_interval=log_interval, verbose=verbose, started=started, worker=worker,
                            claim_lease=claim_lease)
        if on_stats is not None:
            on_stats(runner.stats)
        return runner.run()
