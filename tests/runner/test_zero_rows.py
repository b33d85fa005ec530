"""Input files that hold no rows: the run says so (not "committed by an earlier run"), the
output carries the columns a non-empty job's output has, and verify/status/show agree."""
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.report import plan_report, show_rows, status_report
from batchrun.job.run.runner import run_job
from batchrun.job.jobfile.spec import load_job
from batchrun.job.store.verify import verify
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, read_output

SCHEMA = pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("adapter", pa.string()),
                    ("topic", pa.string_view()), ("score", pa.decimal128(6, 2))])


def run(job, logs):
    return run_job(load_job(job), progress=False, log=logs.append, engine_factory=FakeEngine.from_spec)


def test_zero_row_inputs_write_the_output_schema_and_say_the_input_is_empty(make_job, tmp_path):
    job = make_job(demo_rows(1), input={"passthrough_columns": ["topic", "score"]},
                   sampling={"max_tokens": 8, "stop": ["x"]})
    (tmp_path / "data" / "in.parquet").unlink()
    for name in ("a.parquet", "b.parquet"):
        pq.write_table(SCHEMA.empty_table(), tmp_path / "data" / name)

    assert "0 rows" in plan_report(load_job(job), 1)
    logs = []
    stats = run(job, logs)
    assert stats.status == "done" and stats.units_done == 1 and stats.output_rows == 0
    assert stats.startup_s >= stats.prepare_s > 0  # no generation time is reported for it
    text = "\n".join(logs)
    assert "committed by an earlier run" not in text
    assert "the input has no rows (2 file(s) of 0 rows)" in text

    table = read_output(tmp_path / "out")
    assert table.num_rows == 0
    assert table.schema.names == ["id", "adapter", "output_text", "output_token_ids", "prompt_tokens",
                                  "output_tokens", "finish_reason", "stop_reason", "error", "topic", "score"]
    assert table.schema.field("topic").type == pa.string_view()
    assert table.schema.field("score").type == pa.decimal128(6, 2)

    report, ok = verify(str(tmp_path / "out"))
    assert ok and "verified: 1/1 units (0 rows)" in report, report
    report, code = status_report(str(tmp_path / "out"))
    assert code == 0 and "rows:    0/0 written" in report, report  # ExitCode.OK: complete
    assert show_rows(str(tmp_path / "out"), 5, False) == "(no rows: the job's input has none)"

    logs = []
    again = run(job, logs)
    assert again.units_done == 0 and again.units_skipped == 1
    assert again.startup_s >= again.prepare_s > 0
    assert any("nothing to do: the input has no rows" in line for line in logs), logs


def test_zero_row_output_has_the_same_columns_as_a_non_empty_one(make_job, tmp_path):
    job = make_job(demo_rows(1))
    pq.write_table(pa.Table.from_pylist(demo_rows(3)), tmp_path / "data" / "in.parquet")
    run(job, [])
    full = read_output(tmp_path / "out").schema
    empty_job = make_job(demo_rows(1), output={"path": "out2"})
    pq.write_table(pa.Table.from_pylist(demo_rows(3)).schema.empty_table(), tmp_path / "data" / "in.parquet")
    run(empty_job, [])
    assert read_output(tmp_path / "out2").schema == full
