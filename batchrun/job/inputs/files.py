"""Input Parquet files: check their schemas, read selected rows (finding them: input_files.py).

The schema checks and the row reader share the schema description (InputSchema) and the
per-file Arrow handling (view types: arrow_types.py); the checks must agree exactly with what the
reader later reads.

Checks happen before any model is loaded, and each failure names the file and the column.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchrun.errors import ConfigError
from batchrun.job.inputs.arrow_types import check_round_trip, has_view, plain_table
from batchrun.job.inputs.discovery import find_input_files, glob_root, is_glob  # noqa: F401 (re-exported)
from batchrun.job.jobfile.spec import JOB_ONLY_SAMPLING, OVERRIDE_COLUMNS, InputSpec
from batchrun.job.storage.errors import storage_error
from batchrun.job.storage.options import StorageOptions
from batchrun.job.storage.registry import storage_for
from batchrun.job.storage.uri import is_uri

def _is_str(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_int(t: pa.DataType) -> bool:
    return pa.types.is_integer(t)


def _is_list(t: pa.DataType) -> bool:
    """Any variable-size list layout (list, large_list, list_view, large_list_view)."""
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t)
            or pa.types.is_large_list_view(t))


def _is_messages(t: pa.DataType) -> bool:
    if not _is_list(t):
        return False
    item = t.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(k in names and _is_str(names[k]) for k in ("role", "content"))


@dataclass(frozen=True)
class InputSchema:
    """What the runner needs to know about the input columns (same for every file)."""
    id_type: pa.DataType  # int64 or string
    override_columns: tuple[str, ...]  # sampling override columns present in the input
    passthrough: tuple[tuple[str, pa.DataType], ...] = ()  # input.passthrough_columns, resolved


# The output's fixed and optional columns: a passthrough column may not take one of these names.
OUTPUT_COLUMNS = ("id", "adapter", "sample_index", "output_text", "output_token_ids", "prompt_tokens",
                  "output_tokens", "finish_reason", "stop_reason", "error", "logprobs", "top_logprobs")

_INT_OVERRIDES = ("max_tokens", "top_k", "seed", "min_tokens", "logprobs")
_FLOAT_OVERRIDES = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_BOOL_OVERRIDES = ("include_stop_str_in_output", "ignore_eos")


def _override_type_ok(col: str, t: pa.DataType) -> tuple[bool, str]:
    if pa.types.is_null(t):
        return True, ""
    if col in _INT_OVERRIDES:
        return _is_int(t), "integers"
    if col in _FLOAT_OVERRIDES:
        return _is_int(t) or pa.types.is_floating(t), "numbers"
    if col in _BOOL_OVERRIDES:
        return pa.types.is_boolean(t), "true/false values"
    if col == "response_format":
        return _is_str(t), "JSON strings ({type: json_schema, schema: ...} and the like)"
    listy = _is_list(t)
    if col == "stop":
        return _is_str(t) or (listy and _is_str(t.value_type)), "strings or lists of strings"
    return listy and _is_int(t.value_type), "lists of integer token ids"  # stop_token_ids


def _override_columns(names: set, f: str, schema: pa.Schema, overrides) -> list[str]:
    if overrides == "auto":
        for col in JOB_ONLY_SAMPLING:
            if col in names:
                raise ConfigError(f"input column {col!r} in {f} is named like sampling.{col}, which cannot be "
                                  "set per row (it is job-level only); rename the column, or set "
                                  "sampling.overrides to the list of override columns to use ([] = none)")
        wanted = [c for c in OVERRIDE_COLUMNS if c in names]
    else:
        for col in overrides:
            if col not in names:
                raise ConfigError(f"sampling.overrides: column {col!r} is missing from {f} "
                                  f"(columns: {', '.join(schema.names)})")
        wanted = [c for c in OVERRIDE_COLUMNS if c in overrides]
    for col in wanted:
        t = schema.field(col).type
        ok, kind = _override_type_ok(col, t)
        if not ok:
            raise ConfigError(f"input column {col!r} in {f} overrides sampling.{col} per row and "
                              f"must hold {kind} (or nulls), but has type {t}")
    return wanted


def _passthrough(spec: InputSpec, f: str, schema: pa.Schema, consumed: set) -> list[tuple[str, pa.DataType]]:
    """input.passthrough_columns of one file, resolved ("*": every column, less the job's own
    id/adapter/override columns where they are named like an output column)."""
    wanted = spec.passthrough_columns
    if wanted == "*":
        wanted = [c for c in schema.names if not (c in OUTPUT_COLUMNS and c in consumed)]
    out = []
    for col in wanted:
        if col not in schema.names:
            raise ConfigError(f"input.passthrough_columns: column {col!r} is missing from {f} "
                              f"(columns: {', '.join(schema.names)})")
        if col in OUTPUT_COLUMNS:
            how = ('list the columns to pass through instead of "*"' if spec.passthrough_columns == "*"
                   else "leave it out of the list")
            raise ConfigError(f"input.passthrough_columns: column {col!r} of {f} is named like an output column "
                              f"({', '.join(OUTPUT_COLUMNS)}); rename it in the input, or {how}")
        t = schema.field(col).type
        _check_readable("input.passthrough_columns", f, col, t)
        out.append((col, t))
    return out


def _type_fix(t: pa.DataType, expected: str) -> str:
    binary = (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t)
              or pa.types.is_fixed_size_binary(t))
    if binary and "strings" in expected:
        return ("binary columns are not decoded as text: if it holds UTF-8 text, cast it to string "
                "when writing the file (pyarrow: col.cast(pa.string()))")
    return f"rewrite the column as {expected}, or point the job at another column"


def _check_readable(field: str, f: str, column: str, t: pa.DataType) -> None:
    """A column holding view types is read through their non-view equivalents (arrow_types.py);
    refuse one whose type cannot make that round trip."""
    why = check_round_trip(t)
    if why is not None:
        raise ConfigError(f"{field}: column {column!r} in {f} has type {t}, which batchrun cannot read "
                          f"({why}); rewrite the column with string/binary instead of "
                          "string_view/binary_view")


def read_input_schema(f: str, options: StorageOptions | None = None) -> pa.Schema:
    """An input file's schema; ConfigError if it is not Parquet (a store that refuses the read
    raises StorageError, exit 7: errors.py)."""
    try:
        return storage_for(f, options).read_schema(f)
    except OSError as e:
        if is_uri(f):
            raise storage_error(e, f, "input.path") from None
        raise ConfigError(f"input file {f} is not a readable Parquet file: {e}") from None
    except pa.ArrowException as e:
        raise ConfigError(f"input file {f} is not a readable Parquet file: {e}") from None


def check_schemas(files: list[str], spec: InputSpec, overrides="auto") -> InputSchema:
    """Open every file's footer and check the configured columns exist with usable types.

    ``overrides``: sampling.overrides (auto, or the list of override columns to use).
    """
    id_kinds, overrides_seen, passthrough = set(), None, None
    for f in files:
        schema = read_input_schema(f, spec.storage_options)
        names = set(schema.names)

        def need(field: str, column: str, ok, expected: str) -> pa.DataType:
            if column not in names:
                raise ConfigError(f"input.{field}: column {column!r} is missing from {f} "
                                  f"(columns: {', '.join(schema.names)})")
            t = schema.field(column).type
            if not (ok(t) or pa.types.is_null(t)):
                raise ConfigError(f"input.{field}: column {column!r} in {f} has type {t}, expected {expected}; "
                                  f"{_type_fix(t, expected)}")
            _check_readable(f"input.{field}", f, column, t)
            return t

        if spec.id_column:
            t = need("id_column", spec.id_column, lambda t: _is_int(t) or _is_str(t), "integers or strings")
            id_kinds.add("int" if _is_int(t) else "str" if _is_str(t) else "null")
        if spec.prompt_column:
            need("prompt_column", spec.prompt_column, _is_str, "strings")
        if spec.messages_column:
            need("messages_column", spec.messages_column, _is_messages,
                 "a list of {role: string, content: string} structs")
        if spec.prompt_token_ids_column:
            need("prompt_token_ids_column", spec.prompt_token_ids_column,
                 lambda t: _is_list(t) and _is_int(t.value_type),
                 "a list of integer token ids")
        if spec.adapter_column:
            need("adapter_column", spec.adapter_column, _is_str, "strings (adapter names)")
        present = _override_columns(names, f, schema, overrides)
        if overrides_seen is None:
            overrides_seen = tuple(present)
        elif tuple(present) != overrides_seen:
            raise ConfigError(f"input file {f} has sampling override columns {present}, but earlier files "
                              f"have {list(overrides_seen)}; all files must have the same ones")
        consumed = {spec.id_column, spec.adapter_column, *present}
        these = _passthrough(spec, f, schema, consumed)
        if passthrough is None:
            passthrough = these
        elif these != passthrough:
            raise ConfigError(f"input.passthrough_columns: {f} has columns/types "
                              f"{[(c, str(t)) for c, t in these]}, but earlier files have "
                              f"{[(c, str(t)) for c, t in passthrough]}; passthrough columns must have the same "
                              "type in every file")
    id_kinds.discard("null")
    if len(id_kinds) > 1:
        raise ConfigError(f"input.id_column: column {spec.id_column!r} is integer in some files and "
                          "string in others; use one type")
    id_type = pa.int64() if id_kinds == {"int"} else pa.string()
    return InputSchema(id_type=id_type, override_columns=overrides_seen or (),
                       passthrough=tuple(passthrough or ()))


class RowReader:
    """Reads selected rows of the input files, a row group at a time, with a small cache.

    Consecutive work units usually fall in the same row groups, so keeping the last couple of
    decoded row groups makes reading a shard linear instead of quadratic.
    """

    def __init__(self, files: list[str], columns: list[str], cache_size: int = 2, arrow_columns=(),
                 storage_options: StorageOptions | None = None):
        self.storage_options = storage_options  # input.storage_options, for s3:// files
        # arrow_columns: also returned as Arrow data under rows[ARROW] (passthrough columns)
        self.arrow_columns = list(arrow_columns)
        self._lists = set(columns)
        self.files, self.columns = files, list(dict.fromkeys(list(columns) + self.arrow_columns))
        self._pf: dict[int, tuple[pq.ParquetFile, np.ndarray]] = {}
        self._cache: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()
        self._cache_size = cache_size
        self._arrow_types: dict[str, pa.DataType] | None = None

    def _file(self, fi: int) -> tuple[pq.ParquetFile, np.ndarray]:
        if fi not in self._pf:
            path = self.files[fi]
            try:
                pf = storage_for(path, self.storage_options).parquet_file(path)
            except OSError as e:
                if is_uri(path):
                    raise storage_error(e, path, "input.path") from None
                raise
            md = pf.metadata
            starts = np.zeros(md.num_row_groups + 1, dtype=np.int64)
            starts[1:] = np.cumsum([md.row_group(i).num_rows for i in range(md.num_row_groups)])
            self._pf = {fi: (pf, starts)}  # one open file at a time: shards walk files in order
        return self._pf[fi]

    def _row_group(self, fi: int, rg: int) -> pa.Table:
        key = (fi, rg)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        pf, _ = self._file(fi)
        try:
            table = plain_table(pf.read_row_group(rg, columns=self.columns))
        except OSError as e:  # an object store failing past its retries: exit 7, naming the object
            if is_uri(self.files[fi]):
                raise storage_error(e, self.files[fi], "input.path") from None
            raise
        self._cache[key] = table
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return table

    def read(self, row_file: np.ndarray, row_index: np.ndarray) -> dict[str, list]:
        """Rows (file index, row index within the file), in the given order, as Python lists.

        Strings that are not valid UTF-8 come back as InvalidText (nested cells as INVALID), so
        one bad cell makes one error row instead of failing the unit. Python lists (not one Arrow table) because files may differ in physical types
        (string vs dictionary, int32 vs int64); the runner works row by row anyway.
        """
        out: dict[str, list] = {c: [] for c in self.columns if c not in self.arrow_columns or c in self._lists}
        arrow: dict[str, list] = {c: [] for c in self.arrow_columns}
        # Group runs of equal (file, row group) so each decoded group is sliced once.
        i, n = 0, len(row_file)
        while i < n:
            fi = int(row_file[i])
            _, starts = self._file(fi)
            rg = int(np.searchsorted(starts, row_index[i], side="right") - 1)
            lo, hi = starts[rg], starts[rg + 1]
            j = i + 1
            while j < n and row_file[j] == fi and lo <= row_index[j] < hi:
                j += 1
            piece = self._row_group(fi, rg).take(pa.array(row_index[i:j] - lo))
            for c in out:
                out[c] += column_values(piece.column(c))
            for c in arrow:  # passthrough: back to the input's own type (arrow_types.py)
                col, t = piece.column(c), self._arrow_type(c)
                arrow[c] += (col.cast(t) if has_view(t) else col).chunks
            i = j
        if self.arrow_columns:  # typed, so that no rows still give the output its columns
            out[ARROW] = {c: pa.chunked_array(chunks, type=self._arrow_type(c)) for c, chunks in arrow.items()}
        return out

    def _arrow_type(self, column: str) -> pa.DataType:
        """A passthrough column's input type (check_schemas made it the same in every file)."""
        if self._arrow_types is None:
            schema = read_input_schema(self.files[0], self.storage_options)
            self._arrow_types = {c: schema.field(c).type for c in self.arrow_columns}
        return self._arrow_types[column]


ARROW = "\0arrow"  # RowReader.read: the key under which arrow_columns come back, {name: ChunkedArray}


# ---- values that Arrow stores but Python cannot decode -------------------------------------------

class InvalidText(str):
    """A string cell whose bytes are not valid UTF-8, decoded with ``errors="backslashreplace"``.

    Parquet writers do not all check UTF-8, so a string column can hold bytes that make
    ``to_pylist()`` raise. The replacement is valid text (it can be compared, hashed and written
    out, e.g. as an unknown adapter name), and the type tells the row builder to refuse the row.
    """
    __slots__ = ()


class _Invalid:
    def __repr__(self) -> str:
        return "INVALID"


# A nested cell (e.g. a messages list) holding invalid UTF-8 somewhere inside it.
INVALID = _Invalid()

_BINARY_OF = {pa.string(): pa.binary(), pa.large_string(): pa.large_binary(),
              pa.string_view(): pa.binary_view()}


def column_values(col: pa.Array | pa.ChunkedArray) -> list:
    """``col.to_pylist()``, except that invalid UTF-8 does not raise.

    Invalid strings become InvalidText, nested cells that hold invalid strings become INVALID.
    The fast path is the plain ``to_pylist()``; only a failing chunk is decoded the slow way.
    """
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        pass
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    out: list = []
    for chunk in chunks:
        try:
            out += chunk.to_pylist()
        except UnicodeDecodeError:
            out += _decode_chunk(chunk)
    return out


def _decode_chunk(arr: pa.Array) -> list:
    t = arr.type
    if t in _BINARY_OF:
        return [None if b is None else _decode(b) for b in arr.view(_BINARY_OF[t]).to_pylist()]
    if pa.types.is_dictionary(t):
        values = column_values(arr.dictionary)
        return [None if i is None else values[i] for i in arr.indices.to_pylist()]
    out = []
    for i in range(len(arr)):
        try:
            out.append(arr[i].as_py())
        except UnicodeDecodeError:
            out.append(INVALID)
    return out


def _decode(b: bytes) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return InvalidText(b.decode("utf-8", errors="backslashreplace"))


def first_invalid_utf8(col: pa.Array | pa.ChunkedArray) -> int | None:
    """Row number of the first string that is not valid UTF-8 in a string column, or None."""
    try:
        col.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    for i, v in enumerate(column_values(col)):
        if isinstance(v, InvalidText):
            return i
    return None


def id_array(col: pa.ChunkedArray, id_type: pa.DataType, path: str) -> pa.Array:
    """One file's id column cast to id_type; ConfigError for ids that cannot be written as ids
    (uint64 above the int64 range, strings that are not valid UTF-8), naming the file and row."""
    if pa.types.is_uint64(col.type) and len(col):
        too_big = pc.greater(col, pa.scalar(2**63 - 1, col.type))
        if pc.any(too_big).as_py():
            row = int(np.flatnonzero(too_big.to_numpy(zero_copy_only=False))[0])
            raise ConfigError(f"input.id_column: id {col[row].as_py()} in {path} row {row} does not fit a "
                              "signed 64-bit integer; use smaller ids or string ids")
    ids = col.cast(id_type).combine_chunks()
    if pa.types.is_string(id_type):
        row = first_invalid_utf8(ids)
        if row is not None:
            raise ConfigError(f"input.id_column: id at {path} row {row} is not valid UTF-8; "
                              "ids must be valid text")
    return ids
