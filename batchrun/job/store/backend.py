"""One interface to an output, whatever holds it; ``out.backend`` (layout.py) picks the kind.

``LocalOutput``: a directory, through store/commit.py, claims.py, lock.py and metrics.py (POSIX
renames, O_EXCL claim files, fcntl locks). ``ObjectOutput``: an object-store prefix, through
store/objects/ (a part goes to its final key in one PUT, claims and locks are leases taken with
conditional writes). Both give the same guarantees; what cannot hold on a store is refused there.
The runner, `verify`, `status`, `show`, `plan` and the worker pool ask this interface and never
branch on the kind. (Planning itself, prepare.py, runs one of two flows: a directory's under its
manifest lock, a prefix's in store/objects/job_state.py.)
"""
from __future__ import annotations

import io
import json
import os
import shutil
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.errors import OutputIOError, io_message
from batchrun.job.store import commit as local
from batchrun.job.store import metrics as local_metrics
from batchrun.job.store.claims import UnitClaims, lease_from_env
from batchrun.job.store.lock import TaskLock, is_locked
from batchrun.job.store.objects import commit as objects
from batchrun.job.store.objects import metrics as object_metrics


class _Output:
    """What both kinds share; each kind defines every other method itself (no kind falls back on
    the other's)."""

    def __init__(self, out):
        self.out = out

    def running_tasks(self) -> list[str]:
        """'task-N (owner)' for every task whose lock (or live lease) is held now."""
        return [f"{name[:-5]} ({owner})" for name in self.task_locks()
                if (owner := self.task_holder(name[len("task-"):-len(".lock")]))]


class LocalOutput(_Output):
    """An output directory."""

    # ---- reading (verify, status, show, a run's resume) -------------------------------------------

    def read_commits(self) -> local.Commits:
        return local.read_commits(self.out)

    def check_part(self, unit: int, marker: dict, fingerprint: str | None = None, full: bool = False):
        """None if the unit's part is the one its marker recorded, else why not."""
        return local.check_part(self.out, unit, marker, fingerprint, full)

    def uncommitted_parts(self, total_units: int, commits: local.Commits) -> list[int]:
        return local.uncommitted_parts(self.out, total_units, commits)

    def open_part(self, unit: int) -> pq.ParquetFile:
        return pq.ParquetFile(self.out.part(unit))

    def read_part(self, unit: int, columns=None) -> pa.Table:
        return pq.read_table(self.out.part(unit), columns=columns)

    def read_json(self, path: str):
        """The parsed JSON at ``path``; FileNotFoundError when there is none."""
        with open(path) as f:
            return json.load(f)

    def read_jsons(self, folder: str, prefix: str = "", suffix: str = "") -> list[dict]:
        """The JSON objects named ``prefix*suffix`` in ``folder`` (unreadable, half-written or
        vanished ones, temp files and claims being taken over skipped)."""
        found = []
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if not (name.startswith(prefix) and name.endswith(suffix)) or name.startswith(".") \
                    or ".stale-" in name:
                continue
            try:
                with open(os.path.join(folder, name)) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                found.append(data)
        return found

    def task_holder(self, worker: str) -> str | None:
        """Owner text while the task's lock is held, else None."""
        return is_locked(self.out.lock(worker))

    def task_locks(self) -> list[str]:
        """The task lock names (``task-N.lock``) present."""
        d = self.out.locks
        return sorted(n for n in os.listdir(d) if n.startswith("task-")) if os.path.isdir(d) else []

    def refuse_unowned(self) -> None:
        """What a run would refuse before creating anything: a directory batchrun does not own."""
        from batchrun.job.store.safe_path import check_unowned_dir
        if not os.path.lexists(self.out.manifest):
            check_unowned_dir(self.out)

    def load_plan(self):
        """The stored plan, or None when there is none."""
        from batchrun.job.plan.units import Plan
        try:
            return Plan.load(self.out.plan_dir)
        except FileNotFoundError:
            return None

    def job_metrics(self, total_units: int, total_rows: int, samples_per_row: int = 1) -> dict:
        return local_metrics.job_metrics(self.out, total_units, total_rows, samples_per_row)

    # ---- a run ---------------------------------------------------------------------------------

    def task_lock(self, worker: str, what: str, lease_s: float | None, log):
        """Held while the task runs: the kernel drops it when the process dies."""
        return TaskLock(self.out.lock(worker), what)

    def start_worker(self, worker: str) -> None:
        """A fresh temp folder (a killed run of this worker may have left part files there)."""
        tmp_dir = self.out.tmp(worker)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir, exist_ok=True)
        os.makedirs(self.out.commits, exist_ok=True)

    def end_worker(self, worker: str) -> None:
        shutil.rmtree(self.out.tmp(worker), ignore_errors=True)

    def claims(self, units, worker: str, **kw) -> UnitClaims:
        return UnitClaims(self.out, units, worker, **kw)

    def commit_unit(self, worker: str, unit: int, table: pa.Table, info: dict, fingerprint: str,
                    still_mine) -> bool:
        """Temp file, fsync, rename into the dataset, then the marker (``info`` gets the part's
        record). False, with nothing published, when ``still_mine()`` says the unit was lost."""
        try:
            written = local.write_part(self.out, worker, unit, table)
            if not still_mine():
                os.remove(written.tmp)
                return False
            local.publish_part(self.out, unit, written.tmp)
            info.update(local.part_record(self.out, unit, written, fingerprint))
            local.record_commit(self.out, unit, info)
        except OSError as e:  # disk full, read-only, quota: the unit stays uncommitted
            raise OutputIOError(io_message(e, f"cannot commit unit {unit}")) from None
        return True

    def drop_marker(self, unit: int) -> None:
        """Forget a commit whose part is damaged (the unit runs again)."""
        try:
            os.remove(self.out.commit_marker(unit))
        except FileNotFoundError:
            pass

    def write_metrics(self, worker: str, this_run: dict, total_units: int, total_rows: int,
                      samples_per_row: int = 1) -> None:
        local_metrics.write_metrics(self.out, worker, this_run, total_units, total_rows, samples_per_row)

    def progress_writer(self, folder: str):
        """``write(path, obj)`` for the progress files: a temp file renamed over the old one."""
        os.makedirs(folder, exist_ok=True)
        return local.write_json_atomic


class ObjectOutput(_Output):
    """An object-store prefix (``out.store`` reads and writes its keys)."""

    def __init__(self, out):
        super().__init__(out)
        self.store = out.store

    def read_commits(self) -> local.Commits:
        return objects.read_commits(self.out, self.store)

    def check_part(self, unit: int, marker: dict, fingerprint: str | None = None, full: bool = False):
        return objects.check_part(self.out, self.store, unit, marker, fingerprint, full)

    def uncommitted_parts(self, total_units: int, commits: local.Commits) -> list[int]:
        return objects.uncommitted_parts(self.out, self.store, total_units, commits)

    def open_part(self, unit: int) -> pq.ParquetFile:
        """Fetched whole: parts are unit-sized."""
        got = self.store.get(self.out.part(unit))
        if got is None:
            raise FileNotFoundError(2, "no such object", self.out.part(unit))
        return pq.ParquetFile(io.BytesIO(got.data))

    def read_part(self, unit: int, columns=None) -> pa.Table:
        return self.open_part(unit).read(columns=columns)

    def read_json(self, path: str):
        got = self.store.get(path)
        if got is None:
            raise FileNotFoundError(2, "no such object", path)
        return json.loads(got.data)

    def read_jsons(self, folder: str, prefix: str = "", suffix: str = "") -> list[dict]:
        found = []
        for obj in self.store.list(f"{folder}/{prefix}"):
            if not obj.path.endswith(suffix):
                continue
            got = self.store.get(obj.path)
            try:
                data = json.loads(got.data) if got is not None else None
            except ValueError:
                continue
            if isinstance(data, dict):
                found.append(data)
        return found

    def task_holder(self, worker: str) -> str | None:
        from batchrun.job.store.objects.lock import holder
        return holder(self.store, self.out.lock(worker), lease_from_env())

    def task_locks(self) -> list[str]:
        return [obj.path.rsplit("/", 1)[1] for obj in self.store.list(self.out.locks + "/task-")]

    def refuse_unowned(self) -> None:
        from batchrun.job.store.objects.job_state import check_unowned
        if self.store.stat(self.out.manifest) is None:
            check_unowned(self.out, self.store)

    def load_plan(self):
        """The stored plan, or None when there is none."""
        from batchrun.job.store.objects.job_state import load_plan
        return load_plan(self.out, self.store)

    def job_metrics(self, total_units: int, total_rows: int, samples_per_row: int = 1) -> dict:
        return object_metrics.job_metrics(self.out, total_units, total_rows, samples_per_row)

    @contextmanager
    def _lease_lock(self, lock):
        held = lock.acquire(wait_stale=True)
        try:
            yield held
        finally:
            held.release()

    def task_lock(self, worker: str, what: str, lease_s: float | None, log):
        """A lease renewed while the task runs (store/objects/lock.py); a stale one (a dead node's)
        is waited out, not refused."""
        from batchrun.job.store.objects.lock import ObjectLock
        return self._lease_lock(ObjectLock(self.store, self.out.lock(worker), what, lease_from_env(lease_s), log))

    def start_worker(self, worker: str) -> None:
        pass  # no temp files: a part goes to its final key in one PUT

    def end_worker(self, worker: str) -> None:
        pass

    def claims(self, units, worker: str, **kw):
        from batchrun.job.store.objects.claims import ObjectClaims
        return ObjectClaims(self.out, self.store, units, worker, **kw)

    def commit_unit(self, worker: str, unit: int, table: pa.Table, info: dict, fingerprint: str,
                    still_mine) -> bool:
        """The whole part to its final key (one PUT), then its marker."""
        part = objects.Part(table)
        if not still_mine():
            return False
        etag = objects.publish_part(self.out, self.store, unit, part)
        info.update(objects.part_record(unit, part, etag, fingerprint))
        objects.record_commit(self.out, self.store, unit, info)
        return True

    def drop_marker(self, unit: int) -> None:
        self.store.delete(self.out.commit_marker(unit))

    def write_metrics(self, worker: str, this_run: dict, total_units: int, total_rows: int,
                      samples_per_row: int = 1) -> None:
        object_metrics.write_metrics(self.out, worker, this_run, total_units, total_rows, samples_per_row)

    def progress_writer(self, folder: str):
        """One PUT replaces the object whole."""
        store = self.store
        return lambda path, obj: store.put(path, json.dumps(obj, sort_keys=True).encode())
