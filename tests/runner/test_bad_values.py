"""Bad values inside otherwise well-typed input columns: invalid UTF-8 in string columns,
non-finite or out-of-range per-row sampling overrides, uint64 ids above the int64 range.

Each either becomes an error row (the rest of the job runs, every id still appears once) or, for
ids, a ConfigError naming the file and row before any model is loaded."""
import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.errors import ConfigError
from batchrun.job.inputs.files import INVALID, InvalidText, column_values
from batchrun.job.jobfile.spec import load_job
from batchrun.job.report import plan_report
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, expected, read_output, run_cli

BAD = b"\xff\xfe bad"


def run(job, **kw):
    kw.setdefault("engine_factory", FakeEngine.from_spec)
    return run_job(load_job(job), progress=False, log=lambda m: None, **kw)


def by_id(table: pa.Table) -> dict:
    rows = table.to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id appears more than once"
    return {r["id"]: r for r in rows}


def invalid_strings(values: list) -> pa.Array:
    """A string array holding the given bytes as-is (no UTF-8 check): bytes, str or None."""
    raw = [v.encode() if isinstance(v, str) else v for v in values]
    return pa.array(raw, pa.binary()).view(pa.string())


def write_table(path, columns: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


def rows_with_bad(tmp_path, rows: list[dict], column: str, bad_rows: dict[int, bytes]) -> None:
    """Rewrite data/in.parquet from rows, with raw bytes in `column` at the given row numbers."""
    table = pa.Table.from_pylist(rows)
    values = [bad_rows.get(i, r[column]) for i, r in enumerate(rows)]
    table = table.set_column(table.schema.get_field_index(column), column, invalid_strings(values))
    pq.write_table(table, tmp_path / "data" / "in.parquet")


def plan_error_rows(report: str) -> dict[str, int]:
    """shard name -> the plan table's "error rows" cell."""
    out = {}
    for line in report.splitlines():
        m = re.match(r"^(\S+(?: \(unknown\))?)\s+\d+\s+\S+\s+\d+\s+(\d+)$", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


# ---- the helper --------------------------------------------------------------------------------

def test_invalid_utf8_file_really_fails_to_pylist(tmp_path):
    write_table(tmp_path / "x.parquet", {"prompt": invalid_strings(["ok", BAD, None])})
    col = pq.read_table(tmp_path / "x.parquet").column("prompt")
    with pytest.raises(UnicodeDecodeError):
        col.to_pylist()
    values = column_values(col)
    assert values[0] == "ok" and type(values[0]) is str and values[2] is None
    assert isinstance(values[1], InvalidText) and values[1] == "\\xff\\xfe bad"
    assert values[1].encode("utf-8")  # valid text: it can be written


def test_column_values_dictionary_and_nested():
    dict_col = pa.DictionaryArray.from_arrays(pa.array([0, 1, 0, None]), invalid_strings(["a", BAD]))
    assert column_values(dict_col) == ["a", "\\xff\\xfe bad", "a", None]
    assert isinstance(column_values(dict_col)[1], InvalidText)
    large = invalid_strings([BAD]).view(pa.binary()).cast(pa.large_binary()).view(pa.large_string())
    assert isinstance(column_values(large)[0], InvalidText)
    msgs = _messages_array([[("user", "hi")], [("user", BAD)], None])
    assert column_values(pa.chunked_array([msgs])) == [[{"role": "user", "content": "hi"}], INVALID, None]


# ---- invalid UTF-8 -> error rows ----------------------------------------------------------------

def test_invalid_utf8_prompt_is_one_error_row(make_job, tmp_path):
    rows = demo_rows(12)
    job = make_job(rows)
    rows_with_bad(tmp_path, rows, "prompt", {4: BAD})
    stats = run(job)
    got = by_id(read_output(tmp_path / "out"))
    assert sorted(got) == list(range(12)) and stats.error_rows == 1
    assert got[4]["finish_reason"] == "error" and got[4]["output_text"] is None
    assert got[4]["error"] == "prompt is not valid UTF-8 (column 'prompt')"
    for r in rows:
        if r["id"] != 4:
            assert got[r["id"]]["output_text"] == expected(r["prompt"], r["adapter"])
            assert got[r["id"]]["error"] is None


def test_invalid_utf8_adapter_name_is_an_unknown_adapter(make_job, tmp_path):
    rows = demo_rows(9)
    job = make_job(rows)
    rows_with_bad(tmp_path, rows, "adapter", {1: b"rev\xffse", 5: b"rev\xffse"})
    stats = run(job)
    got = by_id(read_output(tmp_path / "out"))
    assert sorted(got) == list(range(9)) and stats.error_rows == 2
    for i in (1, 5):
        assert got[i]["finish_reason"] == "error"
        assert got[i]["error"] == "unknown adapter 'rev\\\\xffse' (configured adapters: reverse, upper)"
    for r in rows:
        if r["id"] not in (1, 5):
            assert got[r["id"]]["output_text"] == expected(r["prompt"], r["adapter"])


def _messages_array(chats: list) -> pa.Array:
    """list<struct<role, content>> from [[(role, content), ...] | None], content may be raw bytes."""
    offsets, roles, contents, valid = [0], [], [], []
    for chat in chats:
        valid.append(chat is not None)
        for role, content in chat or []:
            roles.append(role)
            contents.append(content)
        offsets.append(len(roles))
    structs = pa.StructArray.from_arrays([pa.array(roles, pa.string()), invalid_strings(contents)],
                                         names=["role", "content"])
    mask = pa.array([not v for v in valid])
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), structs, mask=mask)


def test_invalid_utf8_in_messages_is_an_error_row(make_job, tmp_path):
    job = make_job([{"chat": [{"role": "user", "content": "x"}]}],
                   input={"id_column": None, "prompt_column": None, "messages_column": "chat",
                          "adapter_column": None}, adapters=None)
    chats = [[("user", "hello"), ("user", " fox")], [("user", b"ab\xffc")], [("user", "world")]]
    write_table(tmp_path / "data" / "in.parquet", {"chat": _messages_array(chats)})
    stats = run(job)
    got = by_id(read_output(tmp_path / "out"))
    assert set(got) == {"in.parquet:0", "in.parquet:1", "in.parquet:2"} and stats.error_rows == 1
    assert got["in.parquet:0"]["output_text"] == "hello fox"
    assert got["in.parquet:1"]["error"] == "messages are not valid UTF-8 (column 'chat')"
    assert got["in.parquet:2"]["output_text"] == "world"
    report = plan_report(load_job(job), 1)
    assert plan_error_rows(report) == {"base": 1}


def test_plan_report_counts_invalid_utf8_prompt_as_error_row(make_job, tmp_path):
    rows = demo_rows(9)
    job = make_job(rows)
    rows_with_bad(tmp_path, rows, "prompt", {3: BAD})  # row 3 is a base row
    report = plan_report(load_job(job), 1)
    assert plan_error_rows(report) == {"base": 1, "reverse": 0, "upper": 0}


def test_plan_report_with_invalid_utf8_adapter_name(make_job, tmp_path):
    rows = demo_rows(9)
    job = make_job(rows)
    rows_with_bad(tmp_path, rows, "adapter", {2: b"up\xff"})
    errors = plan_error_rows(plan_report(load_job(job), 1))
    assert errors["up\\xff (unknown)"] == 1 and errors["upper"] == 0


# ---- ids ------------------------------------------------------------------------------------------

def test_invalid_utf8_string_id_is_a_config_error(make_job, tmp_path):
    rows = [{"id": f"r{i}", "prompt": "hello", "adapter": None} for i in range(5)]
    job = make_job(rows)
    rows_with_bad(tmp_path, rows, "id", {3: b"r\xff3"})
    needle = r"input.id_column: id at .*in.parquet row 3 is not valid UTF-8; ids must be valid text"
    with pytest.raises(ConfigError, match=needle):
        plan_report(load_job(job), 1)
    with pytest.raises(ConfigError, match=needle):
        run(job)
    assert not (tmp_path / "out" / "part-000000.parquet").exists()


def uint64_ids(tmp_path, ids: list[int]) -> None:
    write_table(tmp_path / "data" / "in.parquet", {
        "id": pa.array(ids, pa.uint64()), "prompt": pa.array(["hello"] * len(ids)),
        "adapter": pa.array([None] * len(ids), pa.string())})


UINT64_NEEDLE = (r"input.id_column: id 18446744073709551615 in .*in.parquet row 2 does not fit a signed "
                 r"64-bit integer; use smaller ids or string ids")


def test_uint64_id_above_int64_is_a_config_error(make_job, tmp_path):
    job = make_job(demo_rows(1))
    uint64_ids(tmp_path, [0, 7, 2**64 - 1, 2**63])
    with pytest.raises(ConfigError, match=UINT64_NEEDLE):
        plan_report(load_job(job), 1)
    with pytest.raises(ConfigError, match=UINT64_NEEDLE):
        run(job)
    assert not (tmp_path / "out" / "part-000000.parquet").exists()


def test_uint64_ids_that_fit_still_run(make_job, tmp_path):
    job = make_job(demo_rows(1))
    uint64_ids(tmp_path, [0, 7, 2**63 - 1])
    run(job)
    assert sorted(by_id(read_output(tmp_path / "out"))) == [0, 7, 2**63 - 1]


def test_cli_plan_uint64_id_is_one_error_line(make_job, tmp_path):
    job = make_job(demo_rows(1))
    uint64_ids(tmp_path, [0, 7, 2**64 - 1])
    r = run_cli("plan", job)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("batchrun: error:")]
    assert len(errors) == 1 and re.search(UINT64_NEEDLE, errors[0]), r.stderr


# ---- per-row sampling overrides ---------------------------------------------------------------------

def test_non_finite_or_out_of_range_overrides_are_error_rows(make_job, tmp_path):
    nan, inf = math.nan, math.inf
    cases = [  # (temperature, top_p, expected error or None)
        (None, None, None),
        (0.0, 0.5, None),
        (nan, None, "temperature must be a finite number >= 0, got nan"),
        (inf, None, "temperature must be a finite number >= 0, got inf"),
        (-1.0, None, "temperature must be a finite number >= 0, got -1.0"),
        (None, nan, "top_p must be a finite number in (0, 1], got nan"),
        (None, inf, "top_p must be a finite number in (0, 1], got inf"),
        (None, 0.0, "top_p must be a finite number in (0, 1], got 0.0"),
        (-inf, None, "temperature must be a finite number >= 0, got -inf"),
    ]
    rows = [{"id": i, "prompt": "hello", "adapter": None, "temperature": t, "top_p": p}
            for i, (t, p, _) in enumerate(cases)]
    stats = run(make_job(rows))
    got = by_id(read_output(tmp_path / "out"))
    assert sorted(got) == list(range(len(cases)))
    assert stats.error_rows == sum(e is not None for *_, e in cases)
    for i, (*_, err) in enumerate(cases):
        if err is None:
            assert got[i]["error"] is None and got[i]["output_text"] == "hello"
        else:
            assert got[i]["finish_reason"] == "error" and got[i]["output_text"] is None
            assert got[i]["error"] == f"bad per-row sampling override: {err}"


def test_integer_overrides_out_of_range_are_error_rows(make_job, tmp_path):
    rows = [{"id": 0, "prompt": "hello", "adapter": None, "top_k": -1, "max_tokens": None},
            {"id": 1, "prompt": "hello", "adapter": None, "top_k": None, "max_tokens": -5},
            {"id": 2, "prompt": "hello", "adapter": None, "top_k": 3, "max_tokens": 4}]
    run(make_job(rows))
    got = by_id(read_output(tmp_path / "out"))
    assert got[0]["error"] == "bad per-row sampling override: top_k must be an integer >= 0 (0 = off), got -1"
    assert got[1]["error"] == "bad per-row sampling override: max_tokens must be an integer >= 1, got -5"
    assert got[2]["error"] is None and got[2]["output_text"] == "hell"


def test_a_huge_unknown_adapter_name_gives_a_short_error(make_job, tmp_path):
    rows = demo_rows(3)
    rows[1]["adapter"] = "x" * 100_000
    job = make_job(rows)
    run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None)
    out = read_output(tmp_path / "out").to_pylist()
    err = [r["error"] for r in out if r["error"]]
    assert len(err) == 1 and err[0].startswith("unknown adapter 'xxx") and len(err[0]) < 300
    assert sorted(r["id"] for r in out) == [0, 1, 2]
