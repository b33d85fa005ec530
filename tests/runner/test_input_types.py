"""Every Arrow type the input checks accept works end to end (plan, run, output, resume, verify),
and every type they refuse is refused at `plan`, naming the file, the column, the type and a fix.

One parametrized case per (role, type): the column under test replaces the job's id, prompt,
adapter, messages or passthrough column; the other columns stay plain."""
import datetime
import decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.errors import ConfigError
from batchrun.job.report import plan_report
from batchrun.job.run.runner import run_job
from batchrun.job.jobfile.spec import load_job
from batchrun.job.store.verify import verify
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, expected, read_output

N = 9
ROWS = demo_rows(N)
PROMPTS = [r["prompt"] for r in ROWS]
ADAPTERS = [r["adapter"] for r in ROWS]
MSG = pa.struct([("role", pa.string()), ("content", pa.string())])
MSG_LARGE = pa.struct([("role", pa.large_string()), ("content", pa.large_string())])
CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]


def dict_of(values, value_type, index_type=pa.int32()):
    return pa.array(values, value_type).dictionary_encode().cast(pa.dictionary(index_type, value_type))


ID_TYPES = {
    **{str(t): pa.array(range(N), t) for t in (pa.int8(), pa.int16(), pa.int32(), pa.int64(),
                                                pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64())},
    **{str(t): pa.array([f"r{i}" for i in range(N)], t) for t in (pa.string(), pa.large_string(),
                                                                     pa.string_view())},
    "dictionary<string>": dict_of([f"r{i}" for i in range(N)], pa.string()),
    "dictionary<large_string, int8>": dict_of([f"r{i}" for i in range(N)], pa.large_string(), pa.int8()),
    "dictionary<int64>": dict_of(list(range(N)), pa.int64()),  # Parquet reads it back as int64
}

PROMPT_TYPES = {
    "string": pa.array(PROMPTS, pa.string()),
    "large_string": pa.array(PROMPTS, pa.large_string()),
    "string_view": pa.array(PROMPTS, pa.string_view()),
    "dictionary<string>": dict_of(PROMPTS, pa.string()),
}  # (dictionary<string_view> cannot be written to Parquet by pyarrow: no such input file exists)

ADAPTER_TYPES = {
    "string": pa.array(ADAPTERS, pa.string()),
    "large_string": pa.array(ADAPTERS, pa.large_string()),
    "string_view": pa.array(ADAPTERS, pa.string_view()),
    "dictionary<string>": dict_of(ADAPTERS, pa.string()),
    "null": pa.nulls(N, pa.null()),
}

MESSAGES_TYPES = {
    "list": pa.array(CHATS, pa.list_(MSG)),
    "large_list": pa.array(CHATS, pa.large_list(MSG)),
    "list_view": pa.array(CHATS, pa.list_view(MSG)),
    "large_list_view": pa.array(CHATS, pa.large_list_view(MSG)),
    "list<large_string struct>": pa.array(CHATS, pa.list_(MSG_LARGE)),
}  # (list<struct<string_view>> cannot be written to Parquet by pyarrow: "Slicing not implemented")

_D = [decimal.Decimal(i) / 4 for i in range(N)]
_T = [datetime.datetime(2026, 1, 1, i) for i in range(N)]
PASSTHROUGH_TYPES = {
    "string": pa.array(PROMPTS), "large_string": pa.array(PROMPTS, pa.large_string()),
    "string_view": pa.array(PROMPTS, pa.string_view()),
    "dictionary<string>": dict_of(PROMPTS, pa.string()),
    "binary": pa.array([p.encode() for p in PROMPTS], pa.binary()),
    "large_binary": pa.array([p.encode() for p in PROMPTS], pa.large_binary()),
    "binary_view": pa.array([p.encode() for p in PROMPTS], pa.binary_view()),
    "null": pa.nulls(N, pa.null()), "int8": pa.array(range(N), pa.int8()),
    "uint64": pa.array(range(N), pa.uint64()), "float16": pa.array(range(N), pa.float16()),
    "bool": pa.array([i % 2 == 0 for i in range(N)]),
    "decimal128": pa.array(_D, pa.decimal128(10, 2)), "decimal256": pa.array(_D, pa.decimal256(50, 2)),
    "timestamp_tz": pa.array(_T, pa.timestamp("us", tz="Europe/Paris")),
    "date32": pa.array([t.date() for t in _T]), "duration": pa.array([t - _T[0] for t in _T]),
    "list<string_view>": pa.array([[p] for p in PROMPTS], pa.list_(pa.string_view())),
    "large_list<int>": pa.array([[i] for i in range(N)], pa.large_list(pa.int64())),
    "list_view<int>": pa.array([[i] for i in range(N)], pa.list_view(pa.int64())),
    "fixed_size_list": pa.array([[i, i] for i in range(N)], pa.list_(pa.int64(), 2)),
    "struct<string_view>": pa.array([{"a": p} for p in PROMPTS], pa.struct([("a", pa.string_view())])),
    "map": pa.array([[("k", i)] for i in range(N)], pa.map_(pa.string(), pa.int64())),
    "messages": pa.array(CHATS, pa.list_(MSG)),
    "uuid": pa.array([bytes([i]) * 16 for i in range(N)], pa.uuid()),
    "json": pa.array(['{"a": %d}' % i for i in range(N)], pa.json_()),
}

TOKEN_IDS = [[1, 5 + i, 6, 7] for i in range(N)]
TOKEN_ID_TYPES = {
    "list<int32>": pa.array(TOKEN_IDS, pa.list_(pa.int32())),
    "large_list<int8>": pa.array(TOKEN_IDS, pa.large_list(pa.int8())),
    "list_view<uint64>": pa.array(TOKEN_IDS, pa.list_view(pa.uint64())),
    "large_list_view<int64>": pa.array(TOKEN_IDS, pa.large_list_view(pa.int64())),
}

OVERRIDE_TYPES = {  # (column, array, the sampling value every row gets)
    "stop string_view": ("stop", pa.array(["zz"] * N, pa.string_view()), None),
    "stop list<string_view>": ("stop", pa.array([["zz"]] * N, pa.list_(pa.string_view())), None),
    "stop large_list_view<large_string>": ("stop", pa.array([["zz"]] * N, pa.large_list_view(pa.large_string())),
                                           None),
    "stop dictionary<string>": ("stop", dict_of(["zz"] * N, pa.string()), None),
    "max_tokens int8": ("max_tokens", pa.array([3] * N, pa.int8()), 3),
    "max_tokens uint64": ("max_tokens", pa.array([3] * N, pa.uint64()), 3),
    "temperature float16": ("temperature", pa.array([0.0] * N, pa.float16()), None),
    "stop_token_ids list_view<int16>": ("stop_token_ids", pa.array([[99]] * N, pa.list_view(pa.int16())), None),
    "max_tokens null": ("max_tokens", pa.nulls(N, pa.null()), None),
}

REFUSED = [  # (role, name, array)
    ("id", "float64", pa.array([float(i) for i in range(N)])),
    ("id", "binary", pa.array([b"r%d" % i for i in range(N)], pa.binary())),
    ("id", "uuid", pa.array([bytes([i]) * 16 for i in range(N)], pa.uuid())),
    ("prompt", "binary", pa.array([p.encode() for p in PROMPTS], pa.binary())),
    ("prompt", "large_binary", pa.array([p.encode() for p in PROMPTS], pa.large_binary())),
    ("prompt", "binary_view", pa.array([p.encode() for p in PROMPTS], pa.binary_view())),
    ("prompt", "int64", pa.array(range(N))),
    ("adapter", "binary", pa.array([None if a is None else a.encode() for a in ADAPTERS], pa.binary())),
]


def columns(**over) -> dict:
    cols = {"id": pa.array(range(N), pa.int64()), "prompt": pa.array(PROMPTS),
            "adapter": pa.array(ADAPTERS, pa.string())}
    cols.update(over)
    return cols


def write(tmp_path, cols: dict, row_group_size=4) -> None:
    (tmp_path / "data").mkdir(exist_ok=True)
    pq.write_table(pa.table(cols), tmp_path / "data" / "in.parquet", row_group_size=row_group_size)


def run(job):
    return run_job(load_job(job), progress=False, log=lambda m: None, engine_factory=FakeEngine.from_spec)


def end_to_end(job, tmp_path) -> pa.Table:
    """plan, run, verify, a second run (resume: nothing left), verify again; the output table."""
    plan_report(load_job(job), 1)
    stats = run(job)
    assert stats.error_rows == 0
    text, ok = verify(str(tmp_path / "out"))
    assert ok, text
    again = run(job)
    assert again.units_done == 0 and again.units_skipped == again.units_total
    assert verify(str(tmp_path / "out"))[1]
    table = read_output(tmp_path / "out")
    assert table.num_rows == N
    return table


@pytest.mark.parametrize("name", list(ID_TYPES))
def test_id_types(name, make_job, tmp_path):
    job = make_job(ROWS)
    write(tmp_path, columns(id=ID_TYPES[name]))
    table = end_to_end(job, tmp_path)
    want = ID_TYPES[name].cast(pa.string() if "string" in name else pa.int64()).to_pylist()
    got = {r["id"]: r["output_text"] for r in table.to_pylist()}
    assert got == {i: expected(p, a) for i, p, a in zip(want, PROMPTS, ADAPTERS)}


@pytest.mark.parametrize("name", list(PROMPT_TYPES))
def test_prompt_types(name, make_job, tmp_path):
    job = make_job(ROWS)
    write(tmp_path, columns(prompt=PROMPT_TYPES[name]))
    got = {r["id"]: r["output_text"] for r in end_to_end(job, tmp_path).to_pylist()}
    assert got == {i: expected(p, a) for i, p, a in zip(range(N), PROMPTS, ADAPTERS)}


@pytest.mark.parametrize("name", list(ADAPTER_TYPES))
def test_adapter_types(name, make_job, tmp_path):
    job = make_job(ROWS)
    write(tmp_path, columns(adapter=ADAPTER_TYPES[name]))
    got = {r["id"]: r["output_text"] for r in end_to_end(job, tmp_path).to_pylist()}
    want = ADAPTER_TYPES[name].to_pylist()
    assert got == {i: expected(p, a) for i, p, a in zip(range(N), PROMPTS, want)}


@pytest.mark.parametrize("name", list(MESSAGES_TYPES))
def test_messages_types(name, make_job, tmp_path):
    job = make_job(ROWS, input={"prompt_column": None, "messages_column": "chat"})
    write(tmp_path, columns(chat=MESSAGES_TYPES[name]))
    got = {r["id"]: r["output_text"] for r in end_to_end(job, tmp_path).to_pylist()}
    assert got == {i: expected(p, a) for i, p, a in zip(range(N), PROMPTS, ADAPTERS)}


@pytest.mark.parametrize("name", list(PASSTHROUGH_TYPES))
def test_passthrough_types(name, make_job, tmp_path):
    job = make_job(ROWS, input={"passthrough_columns": ["extra"]})
    col = PASSTHROUGH_TYPES[name]
    # pyarrow cannot write a struct<string_view> column in several row groups ("Slicing not
    # implemented for StringView"): such a file is written as one row group
    write(tmp_path, columns(extra=col), row_group_size=None if name.startswith("struct") else 4)
    table = end_to_end(job, tmp_path)
    assert table.schema.field("extra").type == col.type
    got = dict(zip(table.column("id").to_pylist(), table.column("extra").to_pylist()))
    assert got == dict(zip(range(N), col.to_pylist()))


@pytest.mark.parametrize("role,name,col", REFUSED, ids=[f"{r}-{n}" for r, n, _ in REFUSED])
def test_refused_types_name_file_column_type_and_fix(role, name, col, make_job, tmp_path):
    job = make_job(ROWS)
    write(tmp_path, columns(**{role: col}))
    with pytest.raises(ConfigError) as e:
        plan_report(load_job(job), 1)
    msg = str(e.value)
    assert "in.parquet" in msg and repr(role) in msg and str(col.type) in msg, msg
    assert "rewrite the column" in msg or "cast it" in msg, msg  # the fix


@pytest.mark.parametrize("name", list(TOKEN_ID_TYPES))
def test_prompt_token_ids_types(name, make_job, tmp_path):
    job = make_job(ROWS, input={"prompt_column": None, "prompt_token_ids_column": "toks"})
    write(tmp_path, columns(toks=TOKEN_ID_TYPES[name]))
    table = end_to_end(job, tmp_path)
    assert table.column("prompt_tokens").to_pylist() == [4] * N


@pytest.mark.parametrize("name", list(OVERRIDE_TYPES))
def test_override_column_types(name, make_job, tmp_path):
    column, col, max_tokens = OVERRIDE_TYPES[name]
    job = make_job(ROWS)
    write(tmp_path, columns(**{column: col}))
    table = end_to_end(job, tmp_path)
    if max_tokens is not None:
        assert max(table.column("output_tokens").to_pylist()) <= max_tokens


def test_a_view_type_that_cannot_round_trip_is_refused_at_plan(make_job, tmp_path, monkeypatch):
    import batchrun.job.inputs.files as inputs
    job = make_job(ROWS, input={"passthrough_columns": ["extra"]})
    write(tmp_path, columns(extra=PASSTHROUGH_TYPES["string_view"]))
    monkeypatch.setattr(inputs, "check_round_trip", lambda t: "no cast kernel" if str(t) == "string_view" else None)
    with pytest.raises(ConfigError, match=r"input.passthrough_columns: column 'extra' in .*in.parquet has type "
                                          r"string_view, which batchrun cannot read \(no cast kernel\); rewrite"):
        plan_report(load_job(job), 1)


def test_plain_type_replaces_views_at_any_depth():
    from batchrun.job.inputs.arrow_types import plain_type
    t = pa.struct([("a", pa.list_(pa.string_view())), ("m", pa.map_(pa.string_view(), pa.binary_view())),
                   ("d", pa.dictionary(pa.int8(), pa.string_view())), ("n", pa.int32())])
    assert plain_type(t) == pa.struct([("a", pa.list_(pa.large_string())),
                                       ("m", pa.map_(pa.large_string(), pa.large_binary())),
                                       ("d", pa.dictionary(pa.int8(), pa.large_string())), ("n", pa.int32())])
    assert plain_type(pa.list_(pa.int64(), 2)) == pa.list_(pa.int64(), 2)
