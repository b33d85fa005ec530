"""sampling.n > 1: a bad input row is n error rows (one per sample_index, as the output has n rows
per input row), in `plan` and in the run alike; the task's stats and metrics count input rows and
output rows separately."""
import json
import re

import pytest

import pyarrow.compute as pc

from batchrun.job.jobfile.spec import load_job
from batchrun.job.report import plan_report
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, read_output, run_cli

N = 3


def rows_with_bad_ones() -> list[dict]:
    rows = demo_rows(12)  # ids 0..11: base, reverse, upper, base, ...
    for r in rows:
        r["temperature"] = None
    rows[3]["prompt"] = "   "  # base: empty
    rows[4]["prompt"] = "x" * 200  # reverse: prompt + max_tokens over max_model_len 128
    rows[5]["temperature"] = -1.0  # upper: bad per-row override
    rows[7]["adapter"] = "nope"  # unknown adapter: a shard of its own
    return rows


def plan_columns(report: str) -> dict[str, tuple[int, int, int]]:
    """shard -> (rows, output rows, error rows) from the plan table (n > 1 adds 'output rows')."""
    out = {}
    for line in report.splitlines():
        m = re.match(r"^(\S+(?: \(unknown\))?)\s+(\d+)\s+\S+\s+\d+\s+(\d+)\s+(\d+)$", line)
        if m:
            out[m.group(1)] = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
    return out


def test_plan_and_run_agree_on_error_rows_with_n_3(make_job, tmp_path):
    job = make_job(rows_with_bad_ones(), sampling={"max_tokens": 24, "n": N, "temperature": 0.7})
    report = plan_report(load_job(job), 1)
    planned = plan_columns(report)
    assert planned == {"base": (4, 12, 3), "reverse": (3, 9, 3), "upper": (4, 12, 3),
                       "nope (unknown)": (1, 3, 3)}, report
    assert f"a bad input row gives {N} error rows" in report

    stats = run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None)
    table = read_output(tmp_path / "out")
    assert table.num_rows == 12 * N
    errors = table.filter(pc.equal(table["finish_reason"], "error")).to_pylist()
    assert sorted((r["id"], r["sample_index"]) for r in errors) == [(i, k) for i in (3, 4, 5, 7) for k in range(N)]
    by_shard = {}
    for r in errors:
        name = "base" if r["adapter"] is None else r["adapter"] + (" (unknown)" if r["adapter"] == "nope" else "")
        by_shard[name] = by_shard.get(name, 0) + 1
    assert by_shard == {k: v[2] for k, v in planned.items()}  # plan == run, shard by shard

    assert (stats.input_rows, stats.output_rows, stats.error_rows) == (12, 12 * N, 4 * N)
    task = json.loads(next((tmp_path / "out" / "_batchrun" / "metrics").glob("task-*.json")).read_text())
    assert (task["input_rows"], task["output_rows"], task["error_rows"]) == (12, 12 * N, 4 * N)
    job_m = json.loads((tmp_path / "out" / "_batchrun" / "metrics.json").read_text())
    assert (job_m["rows_committed"], job_m["output_rows_committed"], job_m["output_rows_total"],
            job_m["error_rows"]) == (12, 12 * N, 12 * N, 4 * N)


@pytest.mark.slow
def test_summary_names_input_and_output_rows(make_job, tmp_path):
    job = make_job(rows_with_bad_ones(), sampling={"max_tokens": 24, "n": N, "temperature": 0.7})
    r = run_cli("run", job, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"12 input rows -> {12 * N} output rows ({4 * N} error rows)" in r.stderr
    assert f"batchrun: summary rows 12 input -> {12 * N} output ({4 * N} error rows)" in r.stderr


def test_n_1_stats_count_each_row_once(make_job, tmp_path):
    stats = run_job(load_job(make_job(rows_with_bad_ones())), engine_factory=FakeEngine.from_spec,
                    progress=False, log=lambda m: None)
    assert (stats.input_rows, stats.output_rows, stats.error_rows) == (12, 12, 4)
