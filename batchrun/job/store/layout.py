"""The output directory: where each file lives, and the schema of the part files.

    output.path/
      part-000000.parquet ...      the dataset (one file per committed work unit)
      _batchrun/                   metadata; pyarrow/pandas/duckdb skip "_"-prefixed names
        manifest.json              job fingerprint, creation time, the part-file names it owns
        restarting.json            only while a --restart is deleting the previous run (crash-safe)
        plan/                      plan.json + row_file.npy + row_index.npy
        commits/unit-000000.json   one marker per committed unit (rows, errors, tokens)
        claims/unit-000000         a worker's claim on a unit in flight (batchrun/job/store/claims.py)
        tmp/task-0/                part files being written (never visible in the dataset)
        locks/task-0.lock          one fcntl lock per task id (manifest.lock: planning;
                                   metrics.lock: merging metrics.json;
                                   claims.lock: taking over an expired claim)

On an object store (output.path an s3:// or gs:// prefix) the keys are the same; there is no tmp/ (a
part goes to its final key in one PUT) and claims and locks are leases (store/objects/).
        metrics.json               totals over all committed units + each task's last run
        metrics/task-0.json        each task's last run
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pyarrow as pa

from batchrun.job.storage.options import StorageOptions
from batchrun.job.storage.uri import is_uri

META = "_batchrun"


# Columns a job has only when it uses the feature (rows.optional_columns says which).
OPTIONAL_COLUMNS = {
    "sample_index": pa.int32(),  # sampling.n > 1: 0..n-1
    "stop_reason": pa.string(),  # the stop string or stop token id (as text) that ended the row
    "logprobs": pa.list_(pa.float32()),  # one per output token
    "top_logprobs": pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())]))),
}


def output_schema(id_type: pa.DataType, optional=frozenset(), passthrough=()) -> pa.Schema:
    """The part-file schema: fixed columns, the job's optional ones, then passthrough columns."""
    fields = [
        pa.field("id", id_type),
        pa.field("adapter", pa.string()),  # null = base model
        pa.field("sample_index", OPTIONAL_COLUMNS["sample_index"]),
        pa.field("output_text", pa.string()),
        pa.field("output_token_ids", pa.list_(pa.int32())),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("output_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),  # stop | length | error
        pa.field("stop_reason", OPTIONAL_COLUMNS["stop_reason"]),
        pa.field("error", pa.string()),  # null unless finish_reason == "error"
        pa.field("logprobs", OPTIONAL_COLUMNS["logprobs"]),
        pa.field("top_logprobs", OPTIONAL_COLUMNS["top_logprobs"]),
    ]
    fields = [f for f in fields if f.name not in OPTIONAL_COLUMNS or f.name in optional]
    return pa.schema(fields + [pa.field(name, t) for name, t in passthrough])


def part_name(unit: int) -> str:
    return f"part-{unit:06d}.parquet"


@dataclass(frozen=True)
class OutputDir:
    """The output's names. ``path`` is a local directory or an s3:// / gs:// prefix (keys are named like
    the files, ``/``-separated); ``options``: output.storage_options, for a prefix."""
    path: str
    options: StorageOptions | None = None

    @property
    def is_object(self) -> bool:
        return is_uri(self.path)

    @property
    def store(self):
        """The object store holding a prefix (store/objects/ implements the protocol on it)."""
        from batchrun.job.storage.registry import storage_for
        return storage_for(self.path, self.options, "output.path")

    @property
    def backend(self):
        """How this output is read and written: store/backend.py's LocalOutput or ObjectOutput."""
        from batchrun.job.store.backend import LocalOutput, ObjectOutput
        return ObjectOutput(self) if self.is_object else LocalOutput(self)

    @property
    def meta(self) -> str:
        return os.path.join(self.path, META)

    @property
    def manifest(self) -> str:
        return os.path.join(self.meta, "manifest.json")

    @property
    def restart_mark(self) -> str:
        return os.path.join(self.meta, "restarting.json")

    @property
    def plan_dir(self) -> str:
        return os.path.join(self.meta, "plan")

    @property
    def commits(self) -> str:
        return os.path.join(self.meta, "commits")

    @property
    def claims(self) -> str:
        return os.path.join(self.meta, "claims")

    def claim(self, unit: int) -> str:
        return os.path.join(self.claims, f"unit-{unit:06d}")

    @property
    def locks(self) -> str:
        return os.path.join(self.meta, "locks")

    @property
    def metrics(self) -> str:
        return os.path.join(self.meta, "metrics.json")

    @property
    def task_metrics_dir(self) -> str:
        return os.path.join(self.meta, "metrics")

    def tmp(self, task_id: int) -> str:
        return os.path.join(self.meta, "tmp", f"task-{task_id}")

    def part(self, unit: int) -> str:
        return os.path.join(self.path, part_name(unit))

    def commit_marker(self, unit: int) -> str:
        return os.path.join(self.commits, f"unit-{unit:06d}.json")

    def lock(self, task_id: int) -> str:
        return os.path.join(self.locks, f"task-{task_id}.lock")
