"""input.passthrough_columns: any Arrow type comes back unchanged, row for row; bad names are errors."""
import datetime as dt

import pyarrow as pa
import pytest

from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import load_job
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import read_output


def run(job, **kw):
    return run_job(load_job(job), progress=False, log=lambda m: None, engine_factory=FakeEngine.from_spec, **kw)


SCHEMA = pa.schema([
    ("id", pa.int64()), ("prompt", pa.string()),
    ("meta", pa.struct([("k", pa.string()), ("v", pa.list_(pa.int16()))])),
    ("tags", pa.list_(pa.string())),
    ("ts", pa.timestamp("ns", tz="UTC")),
    ("src", pa.dictionary(pa.int8(), pa.string())),
    ("big", pa.large_string()),
])


def rows(n=7):
    return [{"id": i, "prompt": f"hello {i}", "meta": {"k": f"k{i}", "v": [i, -i]} if i != 3 else None,
             "tags": ["a"] * i, "ts": dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc) + dt.timedelta(microseconds=i),
             "src": ["web", "book"][i % 2], "big": "x" * i} for i in range(n)]


def test_passthrough_types_come_back_unchanged(job_factory, tmp_path):
    data = pa.Table.from_pylist(rows(), schema=SCHEMA)
    run(job_factory(rows(), schema=SCHEMA, input={"passthrough_columns": ["meta", "tags", "ts", "src", "big"]}))
    out = read_output(tmp_path / "out").sort_by("id")
    assert out.schema.names[-5:] == ["meta", "tags", "ts", "src", "big"]
    for col in ("meta", "tags", "ts", "src", "big"):
        assert out.schema.field(col).type == SCHEMA.field(col).type, col
        assert out.column(col).to_pylist() == data.column(col).to_pylist(), col
    assert out.column("output_text").to_pylist()[0] == "hello 0"


def test_star_takes_every_input_column_but_the_id(job_factory, tmp_path):
    run(job_factory(rows(), schema=SCHEMA, input={"passthrough_columns": "*"}))
    out = read_output(tmp_path / "out")
    assert out.schema.names[8:] == ["prompt", "meta", "tags", "ts", "src", "big"]
    assert out.schema.field("src").type == SCHEMA.field("src").type


@pytest.mark.parametrize("cols, needle", [
    (["nope"], "input.passthrough_columns: column 'nope' is missing"),
    (["error"], "input.passthrough_columns: column 'error' of .* is named like an output column"),
])
def test_bad_passthrough_columns_are_config_errors(job_factory, cols, needle):
    data = [{**r, "error": "x"} for r in rows(2)]
    with pytest.raises(ConfigError, match=needle):
        run(job_factory(data, input={"passthrough_columns": cols}))


def test_passthrough_must_be_a_list_or_star(job_factory):
    with pytest.raises(ConfigError, match='input.passthrough_columns: expected a list of column names or "\\*"'):
        load_job(job_factory(rows(1), input={"passthrough_columns": "meta"}))
