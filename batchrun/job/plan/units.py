"""Plan a job: group input rows into shards, cut shards into work units, assign units to tasks.

Only the id and adapter columns are read, so planning is cheap: 1M rows take about a second and
a few tens of MB. The base (no-LoRA) shard comes first so its long stretch of work replays the
no-LoRA graph set; then one shard per configured adapter (job-file order); then rows naming
unknown adapters, which become error rows without reaching the engine.

The plan is stored under ``_batchrun/plan/``: ``plan.json`` (files, units) and two ``.npy``
arrays holding, in unit order, each row's file index and row index within that file. A unit is a
slice ``[start, start + rows)`` of those arrays, so the runner reads exactly its rows.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrun.engine.config import AUTO_MAX_NUM_SEQS
from batchrun.job.store.commit import fsync_path
from batchrun.errors import ConfigError
from batchrun.job.inputs.arrow_types import plain_table
from batchrun.job.storage.errors import storage_error
from batchrun.job.storage.registry import storage_for
from batchrun.job.storage.uri import is_uri, relpath as uri_relpath
from batchrun.job.inputs.files import InputSchema, check_schemas, column_values, find_input_files, id_array
from batchrun.job.jobfile.spec import JobSpec

PLAN_FORMAT = 1


@dataclass(frozen=True)
class Unit:
    index: int
    adapter: str | None  # None = base model
    known: bool  # False: the adapter name is not configured -> every row is an error row
    start: int  # offset into the plan's row arrays
    rows: int


@dataclass(frozen=True)
class Shard:
    adapter: str | None
    known: bool
    rows: int
    units: int


@dataclass
class Plan:
    files: list[str]  # absolute paths
    file_names: list[str]  # relative to the input root: default ids are "<name>:<row>"
    file_rows: list[int]
    id_type: str  # "int64" | "string"
    override_columns: list[str]
    units: list[Unit]
    row_file: np.ndarray  # int32 [total_rows], unit order
    row_index: np.ndarray  # int64 [total_rows], unit order
    fingerprint: str = ""
    file_ids: list = field(default_factory=list)  # per file [size, mtime_ns, digest] when planned/run
    passthrough_columns: list = field(default_factory=list)  # input columns copied into the output

    @property
    def total_rows(self) -> int:
        return int(len(self.row_file))

    @property
    def input_schema(self) -> InputSchema:
        return InputSchema(id_type=pa.int64() if self.id_type == "int64" else pa.string(),
                           override_columns=tuple(self.override_columns))

    def shards(self) -> list[Shard]:
        out: dict[tuple, list[Unit]] = {}
        for u in self.units:
            out.setdefault((u.adapter, u.known), []).append(u)
        return [Shard(a, k, sum(u.rows for u in us), len(us)) for (a, k), us in out.items()]

    def unit_rows(self, unit: Unit) -> tuple[np.ndarray, np.ndarray]:
        s = slice(unit.start, unit.start + unit.rows)
        return np.asarray(self.row_file[s]), np.asarray(self.row_index[s])

    # ---- storage ----------------------------------------------------------------------------

    def save(self, plan_dir: str) -> None:
        """Publish atomically: write a private temp dir, then rename it into place.

        Tasks of an array job may plan concurrently; their plans are identical (same fingerprint),
        so whichever rename lands first wins and the others are dropped.
        """
        parent = os.path.dirname(plan_dir)
        tmp = os.path.join(parent, f".plan.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        meta = {k: v for k, v in asdict(self).items() if k not in ("row_file", "row_index", "units")}
        meta["format"] = PLAN_FORMAT
        meta["units"] = [[u.index, u.adapter, u.known, u.start, u.rows] for u in self.units]
        with open(os.path.join(tmp, "plan.json"), "w") as f:
            json.dump(meta, f)
        np.save(os.path.join(tmp, "row_file.npy"), self.row_file)
        np.save(os.path.join(tmp, "row_index.npy"), self.row_index)
        for name in os.listdir(tmp):
            fsync_path(os.path.join(tmp, name))
        try:
            os.rename(tmp, plan_dir)
        except OSError:
            if not os.path.isdir(plan_dir):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another task published the same plan first
        fsync_path(parent)

    @classmethod
    def load(cls, plan_dir: str) -> "Plan":
        with open(os.path.join(plan_dir, "plan.json")) as f:
            meta = json.load(f)
        if meta.pop("format", None) != PLAN_FORMAT:
            raise ConfigError(f"{plan_dir} was written by another batchrun version; rerun with --restart")
        units = [Unit(i, a, k, s, r) for i, a, k, s, r in meta.pop("units")]
        return cls(units=units,
                   row_file=np.load(os.path.join(plan_dir, "row_file.npy"), mmap_mode="r"),
                   row_index=np.load(os.path.join(plan_dir, "row_index.npy"), mmap_mode="r"),
                   **meta)


# ---- planning ---------------------------------------------------------------------------------

def make_plan(spec: JobSpec, files: list[str] | None = None, root: str | None = None,
              schema: InputSchema | None = None) -> Plan:
    """Scan the id/adapter columns and build the plan. Raises ConfigError on bad input."""
    inp = spec.input
    if files is None:
        files, root = find_input_files(inp)
    if schema is None:
        schema = check_schemas(files, inp, spec.sampling.overrides)
    columns = [c for c in (inp.id_column, inp.adapter_column) if c]

    # Global shard codes: 0 = base, 1..k = configured adapters (job order), then unknown names.
    codes_of: dict[str, int] = {name: i + 1 for i, name in enumerate(spec.adapters)}
    unknown: list[str] = []
    file_rows, code_parts, id_parts = [], [], []
    for fi, path in enumerate(files):
        try:
            table = plain_table(storage_for(path, inp.storage_options).dataset(path).to_table(columns=columns))
        except OSError as e:
            if is_uri(path):  # the store failed past its retries: exit 7, naming the object
                raise storage_error(e, path, "input.path") from None
            raise ConfigError(f"input file {path} cannot be read: {e}") from None
        except pa.ArrowException as e:
            raise ConfigError(f"input file {path} cannot be read: {e}") from None
        n = table.num_rows
        file_rows.append(n)
        if inp.adapter_column:
            code_parts.append(_adapter_codes(table.column(inp.adapter_column), codes_of, unknown))
        else:
            code_parts.append(np.zeros(n, dtype=np.int32))
        if inp.id_column:
            col = table.column(inp.id_column)
            if col.null_count:
                first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise ConfigError(f"input.id_column: column {inp.id_column!r} in {path} has a null id "
                                  f"at row {first}; every row needs an id")
            id_parts.append(id_array(col, schema.id_type, path))
    if inp.id_column:
        _check_unique(id_parts, files, inp.id_column)
    del id_parts

    codes = np.concatenate(code_parts) if code_parts else np.zeros(0, np.int32)
    del code_parts
    file_idx = np.repeat(np.arange(len(files), dtype=np.int32), file_rows)
    row_idx = np.arange(len(codes), dtype=np.int64) - np.repeat(
        np.cumsum([0] + file_rows[:-1], dtype=np.int64), file_rows)
    order = np.argsort(codes, kind="stable")  # shard by shard, file/row order inside a shard
    sorted_codes = codes[order]

    names: list[str | None] = [None, *spec.adapters, *unknown]
    units: list[Unit] = []
    bounds = np.searchsorted(sorted_codes, np.arange(len(names) + 1))
    for code, name in enumerate(names):
        lo, hi = int(bounds[code]), int(bounds[code + 1])
        for start in range(lo, hi, inp.rows_per_unit):
            units.append(Unit(len(units), name, code <= len(spec.adapters), start,
                              min(inp.rows_per_unit, hi - start)))
    if not units:  # no input rows: one empty unit, so the output still gets a part file with its
        units.append(Unit(0, None, True, 0, 0))  # columns (readers see the schema, not nothing)

    roots = root or os.path.dirname(files[0])
    return Plan(
        files=list(files),
        file_names=[file_name(f, roots) for f in files],
        file_rows=[int(n) for n in file_rows],
        id_type="int64" if schema.id_type == pa.int64() else "string",
        override_columns=list(schema.override_columns),
        passthrough_columns=[name for name, _ in schema.passthrough],
        units=units,
        row_file=file_idx[order],
        row_index=row_idx[order],
    )


def _adapter_codes(col: pa.ChunkedArray, codes_of: dict[str, int], unknown: list[str]) -> np.ndarray:
    """Map an adapter-name column to shard codes (null and "" -> 0, the base model)."""
    if pa.types.is_null(col.type):
        return np.zeros(len(col), dtype=np.int32)
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    enc = pc.dictionary_encode(col.combine_chunks())
    lut = []
    for name in column_values(enc.dictionary):  # invalid UTF-8 -> InvalidText, an unknown name
        if name is None or name == "":
            lut.append(0)
            continue
        if name not in codes_of:
            codes_of[name] = len(codes_of) + 1
            unknown.append(name)
        lut.append(codes_of[name])
    lut.append(0)  # index -1 (null) -> base
    indices = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.asarray(lut, dtype=np.int32)[indices]


def _check_unique(parts: list[pa.Array], files: list[str], column: str) -> None:
    ids = pa.chunked_array(parts) if parts else pa.chunked_array([], pa.string())
    if pc.count_distinct(ids).as_py() == len(ids):
        return
    counts = pc.value_counts(ids)
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    value = dup[0]["values"].as_py()
    where = [f"{files[fi]} row {int(r)}" for fi, p in enumerate(parts)
             for r in np.flatnonzero(pc.equal(p, pa.scalar(value, p.type)).to_numpy(zero_copy_only=False))][:3]
    raise ConfigError(f"input.id_column: {len(dup)} id(s) in column {column!r} appear more than once, "
                      f"e.g. {value!r} at {', '.join(where)}; ids must be unique")


# ---- tasks ------------------------------------------------------------------------------------

def assign_tasks(plan: Plan, num_tasks: int) -> np.ndarray:
    """Task id of each unit: contiguous runs of units with about equal rows per task.

    Contiguous (not round-robin) so a task's work stays in as few shards as possible: the base
    shard's tasks never switch LoRA on. Deterministic in (plan, num_tasks) only.
    """
    if num_tasks < 1:
        raise ValueError("num_tasks must be >= 1")
    total = max(plan.total_rows, 1)
    mids = np.array([u.start + u.rows / 2 for u in plan.units], dtype=np.float64)
    return np.minimum((mids * num_tasks / total).astype(np.int64), num_tasks - 1)


def task_units(plan: Plan, task_id: int, num_tasks: int) -> list[Unit]:
    tasks = assign_tasks(plan, num_tasks)
    return [u for u, t in zip(plan.units, tasks) if t == task_id]


# ---- engine groups ----------------------------------------------------------------------------

def seqs_bound(max_num_seqs: int | str) -> int:
    """engine.max_num_seqs, or for "auto" (resolved only by the engine, from its KV cache) the
    most it can resolve to."""
    return max(AUTO_MAX_NUM_SEQS.values()) if max_num_seqs == "auto" else max_num_seqs


def group_rows(max_num_seqs: int | str) -> int:
    """Rows the runner hands the engine per ``generate`` call at most (bounds a call's memory)."""
    return max(4096, 32 * seqs_bound(max_num_seqs))


def engine_groups(units: list[Unit], cap: int, max_loras: int) -> list[list[Unit]]:
    """Consecutive units that go to the engine in one ``generate`` call (at most ``cap`` rows).

    Base units group with base units. Adapter units of up to ``max_loras`` different adapters
    share a group, so the engine's steps hold rows of several adapters (every adapter of a
    group fits the GPU slots at once) and the batch does not drain at each adapter boundary.
    Units naming unknown adapters (all error rows) group alone.
    """
    groups: list[list[Unit]] = []
    names: set = set()
    for u in units:
        g = groups[-1] if groups else None
        fits = (g is not None and g[0].known == u.known and (g[0].adapter is None) == (u.adapter is None)
                and sum(x.rows for x in g) + u.rows <= cap)
        if fits and u.known and u.adapter is not None:
            fits = u.adapter in names or len(names) < max(max_loras, 1)
        elif fits and not u.known:
            fits = g[0].adapter == u.adapter
        if fits:
            g.append(u)
        else:
            groups.append([u])
            names = set()
        names.add(u.adapter)
    return groups


def file_name(path: str, root: str) -> str:
    """An input file's name relative to the input's root (default ids and the fingerprint use it)."""
    return uri_relpath(path, root) if is_uri(path) else os.path.relpath(path, root)
