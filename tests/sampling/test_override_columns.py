"""sampling.overrides: auto picks every override column present, a list only those, [] none;
job-level-only fields and badly typed columns are config errors naming the column."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.errors import ConfigError
from batchrun.job.inputs.files import check_schemas
from batchrun.job.jobfile.spec import InputSpec


def write(tmp_path, cols: dict):
    f = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [1], "prompt": ["x"], **cols}), f)
    return [str(f)]


def test_modes(tmp_path):
    files = write(tmp_path, {"stop": pa.array([["a", "b"]]), "temperature": [0.5], "stop_token_ids": [[3]],
                             "ignore_eos": [True]})
    spec = InputSpec(path=files[0], id_column="id")
    assert check_schemas(files, spec).override_columns == ("temperature", "stop", "stop_token_ids", "ignore_eos")
    assert check_schemas(files, spec, ("stop",)).override_columns == ("stop",)
    assert check_schemas(files, spec, ()).override_columns == ()


@pytest.mark.parametrize("cols, overrides, needle", [
    ({"n": [2]}, "auto", "input column 'n' .* is named like sampling.n, which cannot be set per row"),
    ({"stop": [5]}, "auto", "input column 'stop' .* must hold strings or lists of strings"),
    ({"ignore_eos": [1]}, "auto", "input column 'ignore_eos' .* must hold true/false values"),
    ({"stop_token_ids": [["a"]]}, "auto", "input column 'stop_token_ids' .* must hold lists of integer token ids"),
    ({}, ("min_tokens",), "sampling.overrides: column 'min_tokens' is missing"),
])
def test_errors(tmp_path, cols, overrides, needle):
    files = write(tmp_path, cols)
    with pytest.raises(ConfigError, match=needle):
        check_schemas(files, InputSpec(path=files[0], id_column="id"), overrides)


def test_n_column_is_fine_when_overrides_are_listed(tmp_path):
    files = write(tmp_path, {"n": [2], "seed": [4]})
    assert check_schemas(files, InputSpec(path=files[0], id_column="id"), ("seed",)).override_columns == ("seed",)


def test_plan_counts_bad_override_rows_as_the_run_does(job_factory, tmp_path):
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.report import plan_report
    from batchrun.job.run.runner import run_job
    from tests.helpers.fake_engine import FakeEngine
    rows = [{"id": 0, "prompt": "hello", "min_tokens": 2, "stop": ["x"]},
            {"id": 1, "prompt": "abc", "min_tokens": 50, "stop": None},  # min_tokens > max_tokens
            {"id": 2, "prompt": "fox", "min_tokens": None, "stop": [""]},  # empty stop string
            {"id": 3, "prompt": "run", "min_tokens": None, "stop": None}]
    job = job_factory(rows)
    line = next(l.split() for l in plan_report(load_job(job), 1).splitlines() if l.startswith("base "))
    assert line[-1] == "2", line
    stats = run_job(load_job(job), progress=False, log=lambda m: None, engine_factory=FakeEngine.from_spec)
    assert stats.error_rows == 2
