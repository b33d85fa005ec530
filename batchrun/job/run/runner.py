"""Run one worker of a job: claim uncommitted units (batchrun/job/store/claims.py) and run them, base shard
first, then adapters; any number of workers may share one output directory.

Three threads: the feeder (``feeder.py``) reads and tokenizes the next units ahead of the GPU;
the engine thread (this one, which also takes the signals) streams their requests through
``Engine.generate_stream``, so consecutive units and shards share steps and the batch never
drains at a unit or shard boundary; the writer (``writer.py``) writes and commits each unit the
moment its last row finishes. A crash loses at most the units still in flight or queued for the
writer; nothing visible is ever partial (``commit.py``).

Size (~490 lines): the worker's whole life (resume check, claims, the three threads, commits,
failure handling) is one state machine whose invariants (exactly-once commits, what a signal may
interrupt) are easier to check in one place; the threads' bodies are feeder.py and writer.py.
"""
from __future__ import annotations

import functools
import re
import threading
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterable

import numpy as np

from batchrun.common import preload
from batchrun.job.store.claims import UnitClaims
from batchrun.engine.request import Result
from batchrun.errors import ConfigError, OutputIOError
from batchrun.job.run.feeder import Feeder, UnitSource
from batchrun.job.run.interrupt import Interrupted, Signals
from batchrun.job.inputs.files import RowReader
from batchrun.job.jobfile.spec import JobSpec
from batchrun.job.store.lock import LockBusy
from batchrun.job.plan.units import Unit, assign_tasks, seqs_bound
from batchrun.job.run.progress_bar import Progress
from batchrun.job.plan.prepare import Prepared, prepare
from batchrun.job.inputs.rows import UnitWork, arrow_columns, build_unit, input_columns, unit_table
from batchrun.job.run.progress_files import ProgressFile
from batchrun.job.run.writer import Writer

FEEDER_AHEAD_BATCHES = 2  # the feeder reads and claims at most this many engine batches of rows ahead
WRITER_QUEUE_UNITS = 4  # finished units that may wait for the writer before the engine thread blocks


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
    input_rows: int = 0  # input rows finished: every one of their sampling.n samples has a result
    output_rows: int = 0  # output rows finished (one per sample: input_rows x sampling.n when done)
    error_rows: int = 0  # output rows of the units this run committed that are error rows (n per bad input row)
    committed_rows: int = 0  # input rows of the units this run committed (what the summary reports)
    committed_output_rows: int = 0  # their output rows (committed_rows x sampling.n)
    prompt_tokens: int = 0
    output_tokens: int = 0
    started: float = field(default_factory=time.time)
    elapsed_s: float = 0.0
    model_load_s: float = 0.0
    startup_s: float = 0.0  # from the start of run_job until the engine was ready (checks, plan, load)
    prepare_s: float = 0.0  # of which checks, digests, fingerprint and plan (prepare.prepare)
    import_wait_s: float = 0.0  # of which waiting for the preload thread's imports and tokenizer
    writing_s: float = 0.0  # writing, publishing and committing part files (on the writer thread)
    writer_wait_s: float = 0.0  # the engine thread blocked on the writer (full queue, final drain)
    error_reasons: dict = field(default_factory=dict)  # reason (digits as N) -> error rows

    @property
    def generation_s(self) -> float:
        """Wall time after start-up (checks, plan, model load), less the time the engine thread
        waited for the writer (writing overlaps generation, so only waiting on it is not
        generation)."""
        return max(self.elapsed_s - max(self.startup_s, self.model_load_s) - self.writer_wait_s, 0.0)

    @property
    def output_tok_per_s(self) -> float:
        gen = self.generation_s
        return self.output_tokens / gen if gen > 0 else 0.0


def load_engine(spec: JobSpec):
    """The real engine (imported late: planning and validation never need torch; `batchrun run`
    has imported it on the preload thread meanwhile)."""
    preload.wait()
    from batchrun.engine.engine import Engine
    return Engine.from_config(spec.engine, adapters=dict(spec.adapters))


class TaskRunner:
    def __init__(self, prep: Prepared, task_id: int, num_tasks: int, engine_factory: Callable,
                 progress: bool | str = True, log=print, log_interval: float = 30.0, verbose: bool = False,
                 started: float | None = None, worker: str | None = None, claim_lease: float | None = None):
        self.prep, self.spec, self.out, self.plan = prep, prep.spec, prep.out, prep.plan
        self.backend = prep.out.backend  # the output's commits, claims, metrics (store/backend.py)
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
        self.progress_file: ProgressFile | None = None  # _batchrun/progress/<worker>.json, for `status`
        self._lock = threading.Lock()  # stats and progress: the engine and writer threads both count

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
        with self._commit_guard():
            still_mine = (lambda: True) if self.claims is None else (lambda: self.claims.still_mine(unit))
            if not self.backend.commit_unit(self.worker, unit, table, info, self.prep.fingerprint, still_mine):
                self._lost(unit)
                return
            if self.claims is not None:
                self.claims.release(unit)
        st = self.stats
        with self._lock:
            st.writing_s += time.time() - t0
            st.units_done += 1
            st.committed_rows += work.unit.rows
            st.committed_output_rows += len(work.results)
            st.error_rows += errors
            st.prompt_tokens += info["prompt_tokens"]
            if self.progress is not None:
                self.progress.unit(unit, work.unit.rows, errors)
        self._note_progress()

    def _lost(self, unit: int) -> None:
        """Our lease expired and another worker took the unit over: drop our result."""
        self.claims.release(unit, committed=False)
        self.stats.units_lost += 1
        self.log(f"task {self.task_id}/{self.num_tasks}: unit {unit} was taken over by another "
                 "worker (this worker's claim expired); its result is discarded")

    def _note_progress(self, force: bool = False) -> None:
        """Refresh this worker's progress file (rate-limited unless ``force``); a progress file
        that cannot be written never fails the run."""
        pf = self.progress_file
        if pf is None:
            return
        with self._lock:  # a consistent snapshot; the write itself must not block the engine thread
            snapshot = replace(self.stats)
        try:
            pf.update(snapshot, force)
        except OSError as e:
            self.log(f"warning: could not write {pf.path}: {e}")
            self.progress_file = None

    def _commit_guard(self):
        """On the main thread, SIGTERM/SIGINT wait until the commit ends. The writer thread needs
        nothing: Python runs signal handlers on the main thread only, so no signal cuts it."""
        if threading.current_thread() is threading.main_thread():
            return self.signals.deferred()
        return nullcontext()

    def _on_result(self, pending: dict[int, UnitWork], done: Callable[[UnitWork], None]) -> Callable[[Result], None]:
        def on_result(res: Result) -> None:
            self.signals.check()  # a signal whose Interrupted was swallowed (interrupt.py) ends the run here
            unit_index, pos = res.request_id
            work = pending.get(unit_index)
            if work is None or work.results[pos] is not None:
                return
            work.results[pos] = res
            self._row_done(res, _row_complete(work, pos))
            if res.finish_reason == "error" and self.spec.on_error == "fail":
                raise RowFailure(self._fail_message(work.ids[pos], res.error))
            if work.remaining == 0:
                del pending[unit_index]
                done(work)
        return on_result

    def _row_done(self, res: Result, input_row_complete: bool) -> None:
        with self._lock:
            self._count_row(res, input_row_complete)

    def _count_row(self, res: Result, input_row_complete: bool) -> None:
        st = self.stats
        st.output_rows += 1
        st.input_rows += input_row_complete
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
        commits = self.backend.read_commits()
        return {u.index for u in mine if self._verified_commit(u, commits)}

    def _verified_commit(self, u: Unit, commits) -> bool:
        """One unit of ``_verified_commits``: True if its commit checks out (``commits``: read_commits)."""
        reason = commits.damaged.get(u.index)
        if reason is None and u.index in commits.valid:
            reason = self.backend.check_part(u.index, commits.valid[u.index], self.prep.fingerprint)
            if reason is None:
                return True
        if reason is not None:
            self.log(f"task {self.task_id}: unit {u.index} was committed but {reason}; rewriting it")
            self.backend.drop_marker(u.index)
            self.stats.units_repaired += 1
        return False

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
        self.backend.start_worker(self.worker)
        name = f"task {self.task_id}/{self.num_tasks}"
        try:
            self.progress_file = ProgressFile(self.out, self.worker)
        except OSError as e:
            self.log(f"warning: no progress file for `batchrun status`: {e}")
        self._note_progress(force=True)
        try:
            self.signals.install()
            if not todo:
                st.startup_s = time.time() - st.started  # all of it: no generation to count
                self.log(f"{name}: nothing to do: " + (
                    f"the input has no rows ({len(self.plan.files)} file(s) of 0 rows)" if not self.plan.total_rows
                    else f"all {len(units)} of its units were committed by an earlier run"))
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
            self.claims = self.backend.claims(units, self.worker, start=self._home(), done=done,
                                              lease_s=self.claim_lease, log=self.log)
            claimed = iter(self.claims)
            first = next((u for u in claimed if u is not None), None)  # waits while others hold every unit
            if first is None:
                self.log(f"{name}: nothing to do: other workers committed the remaining units")
                st.status = "done"
                return st
            if not self.plan.total_rows:  # the plan's one empty unit: no engine, nothing to generate
                self._commit_empty(_chain(first, claimed))
                st.startup_s = time.time() - st.started
                self.log(f"{name}: the input has no rows ({len(self.plan.files)} file(s) of 0 rows); wrote "
                         "an empty part file with the output's columns")
                st.status = "done"
                return st
            t0 = time.time()
            engine = self.engine_factory(self.spec)
            st.model_load_s = time.time() - t0
            st.startup_s = time.time() - st.started
            summary = getattr(engine, "memory_summary", None)
            if summary is not None:  # (test engines may not have one)
                self.log(f"{name}: engine ready in {st.model_load_s:.1f} s: {summary()}")
            self._note_progress(force=True)  # the engine is ready: rates count from here
            st.import_wait_s = preload.waited_s
            if self.mode != "none":
                n = self.spec.sampling.n  # the whole job, with the units committed before this run done
                self.progress = Progress(self.mode, f"task {self.task_id}/{self.num_tasks}",
                                         self.plan.total_rows * n, len(units), self.log, self.log_interval,
                                         self.verbose, done_rows=sum(u.rows for u in units if u.index in done) * n,
                                         done_units=len(done))
            self._run_units(engine, _chain(first, claimed))
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
            self.backend.end_worker(self.worker)
            st.elapsed_s = time.time() - st.started
            self._note_progress(force=True)
            self._write_metrics()
        return st

    def _commit_empty(self, todo: Iterable[Unit]) -> None:
        """Commit units of no rows (make_plan's one unit for an input without rows): each part
        file holds the output's columns, passthrough columns typed as in the input."""
        reader = RowReader(self.plan.files, input_columns(self.spec, self.plan), arrow_columns=arrow_columns(self.plan),
                           storage_options=self.spec.input.storage_options)
        for unit in todo:
            if unit is None:
                continue
            rf, ri = self.plan.unit_rows(unit)
            assert not unit.rows, "_commit_empty takes units of no rows"
            self._finish(build_unit(unit, reader.read(rf, ri), rf, ri, self.plan, self.spec, None, None))

    def _run_units(self, engine, todo: Iterable[Unit]) -> None:
        """Stream ``todo`` (any iterable, consumed lazily and in order; ``None`` items = the claims
        wait on other workers) through the engine."""
        spec = self.spec
        _settle_tokenizer(engine.tokenizer)
        reader = RowReader(self.plan.files, input_columns(spec, self.plan), arrow_columns=arrow_columns(self.plan),
                           storage_options=spec.input.storage_options)
        check = functools.partial(engine.check_request, job=True)

        def build(unit: Unit) -> UnitWork:  # on the feeder thread
            rf, ri = self.plan.unit_rows(unit)
            pins = self.prep.pins
            pins.check(rf)  # before and after: a file replaced mid-read mixes rows
            try:
                rows = reader.read(rf, ri)
            except Exception:
                pins.check(rf)  # a file that changed under the reader says so ...
                raise  # ... anything else is a real failure
            pins.check(rf)
            work = build_unit(unit, rows, rf, ri, self.plan, spec, engine.tokenizer, check)
            bad = work.first_error()
            if bad and spec.on_error == "fail":
                raise RowFailure(self._fail_message(*bad))
            return work

        pending: dict[int, UnitWork] = {}
        writer = Writer(self._finish, WRITER_QUEUE_UNITS).start()
        # claims go ahead of the engine only this far: enough to refill its batch, little enough that
        # other workers of the output dir still find units (and bounded memory)
        seqs = getattr(getattr(engine, "config", None), "max_num_seqs", None)  # resolved by the engine
        seqs = seqs if isinstance(seqs, int) else seqs_bound(spec.engine.max_num_seqs)
        feeder = Feeder(todo, build, ahead_rows=FEEDER_AHEAD_BATCHES * seqs).start()
        shard = [object()]

        def on_unit(work: UnitWork) -> None:  # on the engine thread, as the unit's requests go out
            self.prep.pins.check(self.plan.unit_rows(work.unit)[0])  # still the pinned file
            if self.progress is not None and work.unit.adapter != shard[0]:
                shard[0] = work.unit.adapter
                self.progress.set_shard(work.unit.adapter)
            for pos, r in enumerate(work.results):  # error rows, decided before the engine
                if r is not None:
                    self._row_done(r, pos % work.n == work.n - 1 and _row_complete(work, pos))
            if work.remaining == 0:
                writer.put(work)
            else:
                pending[work.unit.index] = work

        source = UnitSource(feeder, on_unit, poll=writer.check)
        on_result = self._on_result(pending, writer.put)
        try:
            engine.generate_stream(source, on_result)
            if source.error is not None:  # the units before it ran and are committed below
                raise source.error
            if pending:
                missing = sorted(pending)
                raise RuntimeError(f"engine returned no result for some rows of units {missing[:5]}")
            feeder.close()
            writer.close()
        except BaseException as e:
            self._drain(feeder, writer, e)
            raise
        finally:
            self.stats.writer_wait_s += writer.wait_s

    def _drain(self, feeder: Feeder, writer: Writer, error: BaseException) -> None:
        """The run is failing: stop the feeder, and still commit the units that finished before
        ``error`` (as a run that commits on its own thread would have), with signals deferred so
        a second Ctrl-C does not cut the wait; a writer error of its own is logged, ``error`` wins."""
        with self.signals.deferred():
            feeder.close()
            try:
                writer.close()
            except Exception as e:
                if e is not error:
                    self.log(f"task {self.task_id}: while stopping: {e}")

    # ---- metrics ----------------------------------------------------------------------------

    def _write_metrics(self) -> None:
        try:
            this_run = {**asdict(self.stats), "output_tok_per_s": self.stats.output_tok_per_s}
            self.backend.write_metrics(self.worker, this_run, len(self.plan.units), self.plan.total_rows,
                                       self.spec.sampling.n)
        except (OSError, LockBusy, OutputIOError) as e:  # metrics must never turn a finished run into a failed one
            self.log(f"warning: could not write metrics: {e}")


_DIGITS = re.compile(r"\d+")  # error reasons are counted with their numbers as N


def _settle_tokenizer(tokenizer) -> None:
    """Encode once on this thread before the feeder thread shares the tokenizer: a fast
    tokenizer resets its truncation/padding state on its first call (a mutation that must not
    race the engine thread's decode); later calls only read it."""
    if tokenizer is not None and callable(tokenizer):
        tokenizer(["a"])


def _row_complete(work: UnitWork, pos: int) -> bool:
    """Whether every sample of slot ``pos``'s input row has its result (slots ``row*n .. row*n+n-1``)."""
    lo = pos - pos % work.n
    return all(r is not None for r in work.results[lo:lo + work.n])


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
    prepared = time.time() - started
    worker = worker or str(task_id)
    with prep.out.backend.task_lock(worker, f"task {worker} of {prep.out.path}", claim_lease, log):
        runner = TaskRunner(prep, task_id, num_tasks, engine_factory or load_engine, progress=progress, log=log,
                            log_interval=log_interval, verbose=verbose, started=started, worker=worker,
                            claim_lease=claim_lease)
        runner.stats.prepare_s = prepared
        if on_stats is not None:
            on_stats(runner.stats)
        return runner.run()
