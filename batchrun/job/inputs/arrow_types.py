"""Arrow view types (string_view, binary_view) read as their large non-view equivalents.

pyarrow has no take/slice kernels for the view layouts (ArrowNotImplementedError "array_take",
"Slicing not implemented for StringView"), and batchrun takes rows out of every row group it
reads. So every input column is read as ``plain_type`` of its type: string_view -> large_string,
binary_view -> large_binary, at any depth (list items, struct fields, map keys/items, dictionary
values). The values are the same; large_ offsets hold any row group a view could. A passthrough
column is cast back to its input type after the take, so the output keeps the input's type.
"""
from __future__ import annotations

import pyarrow as pa

_PLAIN = {pa.string_view(): pa.large_string(), pa.binary_view(): pa.large_binary()}


def plain_type(t: pa.DataType) -> pa.DataType:
    """``t`` with every view type inside it replaced by its large non-view type."""
    if t in _PLAIN:
        return _PLAIN[t]
    if pa.types.is_dictionary(t):
        return pa.dictionary(t.index_type, plain_type(t.value_type), t.ordered)
    if pa.types.is_map(t):
        return pa.map_(_field(t.key_field), _field(t.item_field), t.keys_sorted)
    if pa.types.is_fixed_size_list(t):
        return pa.list_(_field(t.value_field), t.list_size)
    for is_kind, make in ((pa.types.is_list, pa.list_), (pa.types.is_large_list, pa.large_list),
                          (pa.types.is_list_view, pa.list_view),
                          (pa.types.is_large_list_view, pa.large_list_view)):
        if is_kind(t):
            return make(_field(t.value_field))
    if pa.types.is_struct(t):
        return pa.struct([_field(t.field(i)) for i in range(t.num_fields)])
    return t


def _field(f: pa.Field) -> pa.Field:
    return f.with_type(plain_type(f.type))


def has_view(t: pa.DataType) -> bool:
    return plain_type(t) != t


def plain_table(table: pa.Table | pa.RecordBatch) -> pa.Table | pa.RecordBatch:
    """``table`` (or record batch) with each column that holds a view type cast to ``plain_type``."""
    schema = pa.schema([_field(f) for f in table.schema], metadata=table.schema.metadata)
    return table if schema == table.schema else table.cast(schema)


def check_round_trip(t: pa.DataType) -> str | None:
    """Why a column of type ``t`` cannot be read as ``plain_type(t)`` and cast back, or None.

    Cast kernels are chosen by type alone, so an empty array answers for every length."""
    if not has_view(t):
        return None
    try:
        pa.array([], t).cast(plain_type(t)).cast(t)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid) as e:
        return str(e)
    return None


def take(col: pa.Array | pa.ChunkedArray, indices: pa.Array) -> pa.Array | pa.ChunkedArray:
    """``col.take(indices)`` for any type: a view type goes through ``plain_type`` and back."""
    if not has_view(col.type):
        return col.take(indices)
    return col.cast(plain_type(col.type)).take(indices).cast(col.type)
