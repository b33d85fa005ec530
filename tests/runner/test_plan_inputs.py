"""Planning (shards, units, tasks) and input checks, without any model."""
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchrun.errors import ConfigError
from batchrun.job.inputs.files import RowReader, check_schemas, find_input_files
from batchrun.job.jobfile.spec import parse_job
from batchrun.job.plan.units import Plan, assign_tasks, make_plan, task_units
from tests.helpers.jobs import write_rows


def spec_for(tmp_path, path="data", adapters=("reverse", "upper"), **inp):
    raw = {"model": "m", "adapters": {a: a for a in adapters},
           "input": {"path": path, "id_column": "id", "adapter_column": "adapter", "rows_per_unit": 3, **inp},
           "output": {"path": "out"}}
    if not adapters:
        raw.pop("adapters")
    return parse_job(raw, base_dir=tmp_path)


def rows(ids, adapters):
    return [{"id": i, "prompt": f"p{i}", "adapter": a} for i, a in zip(ids, adapters)]


def test_shards_base_first_then_adapters_in_job_order_then_unknown(tmp_path):
    ad = [None, "upper", "", "reverse", "upper", None, "nope", "reverse", None, None, "upper", None]
    write_rows(tmp_path / "data" / "a.parquet", rows(range(6), ad[:6]))
    write_rows(tmp_path / "data" / "b.parquet", rows(range(6, 12), ad[6:]))
    plan = make_plan(spec_for(tmp_path))
    shards = [(s.adapter, s.known, s.rows, s.units) for s in plan.shards()]
    assert shards == [(None, True, 6, 2), ("reverse", True, 2, 1), ("upper", True, 3, 1), ("nope", False, 1, 1)]
    assert all(1 <= u.rows <= 3 for u in plan.units)
    assert [u.index for u in plan.units] == list(range(len(plan.units)))
    # every row exactly once, and each unit's rows have the unit's adapter
    seen = []
    for u in plan.units:
        rf, ri = plan.unit_rows(u)
        for f, r in zip(rf, ri):
            gid = int(f) * 6 + int(r)
            seen.append(gid)
            assert (ad[gid] or None) == u.adapter
    assert sorted(seen) == list(range(12))
    # inside a shard, rows keep file/row order (sequential reads)
    rf, ri = plan.unit_rows(plan.units[0])
    assert list(zip(rf, ri)) == [(0, 0), (0, 2), (0, 5)]


def test_no_adapter_column_means_one_base_shard_and_default_ids(tmp_path):
    write_rows(tmp_path / "data" / "x" / "a.parquet", [{"prompt": "a"}] * 4)
    write_rows(tmp_path / "data" / "_ignored.parquet", [{"prompt": "z"}])
    plan = make_plan(spec_for(tmp_path, adapters=(), id_column=None, adapter_column=None))
    assert [(s.adapter, s.rows) for s in plan.shards()] == [(None, 4)]
    assert plan.file_names == [os.path.join("x", "a.parquet")] and plan.id_type == "string"


def test_duplicate_and_null_ids_are_config_errors(tmp_path):
    write_rows(tmp_path / "data" / "a.parquet", rows([1, 2, 3], [None] * 3))
    write_rows(tmp_path / "data" / "b.parquet", rows([4, 2], [None] * 2))
    with pytest.raises(ConfigError, match=r"input.id_column: 1 id\(s\) in column 'id' appear more than once, "
                                          r"e.g. 2 at .*a.parquet row 1, .*b.parquet row 1"):
        make_plan(spec_for(tmp_path))
    write_rows(tmp_path / "data" / "b.parquet", rows([4, None], [None] * 2))
    with pytest.raises(ConfigError, match=r"null id at row 1"):
        make_plan(spec_for(tmp_path))


def test_task_assignment_is_contiguous_disjoint_and_covering(tmp_path):
    write_rows(tmp_path / "data" / "a.parquet", rows(range(50), [None, "reverse", None, "upper", None] * 10))
    plan = make_plan(spec_for(tmp_path))
    for n in (1, 2, 3, 7, 40):
        tasks = assign_tasks(plan, n)
        assert list(tasks) == sorted(tasks)  # contiguous runs
        per = [task_units(plan, t, n) for t in range(n)]
        ids = [u.index for us in per for u in us]
        assert sorted(ids) == list(range(len(plan.units))) and len(ids) == len(set(ids))
        if n <= len(plan.units):
            sizes = [sum(u.rows for u in us) for us in per]
            assert max(sizes) - min(sizes) <= 2 * 3  # within two units of rows
        assert list(assign_tasks(plan, n)) == list(tasks)  # deterministic


def test_plan_save_load_roundtrip(tmp_path):
    write_rows(tmp_path / "data" / "a.parquet", rows(range(10), [None, "upper"] * 5))
    plan = make_plan(spec_for(tmp_path))
    plan.fingerprint = "abc"
    plan.save(str(tmp_path / "plan"))
    plan.save(str(tmp_path / "plan"))  # a second (concurrent) publisher loses quietly
    back = Plan.load(str(tmp_path / "plan"))
    assert back.units == plan.units and back.fingerprint == "abc"
    assert np.array_equal(back.row_file, plan.row_file) and np.array_equal(back.row_index, plan.row_index)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".plan")]


def test_row_reader_crosses_row_groups_and_files(tmp_path):
    write_rows(tmp_path / "data" / "a.parquet", rows(range(10), [None] * 10), row_group_size=3)
    write_rows(tmp_path / "data" / "b.parquet", rows(range(10, 14), [None] * 4), row_group_size=2)
    files, _ = find_input_files(spec_for(tmp_path).input)
    reader = RowReader(files, ["id", "prompt"])
    got = reader.read(np.array([0, 0, 0, 0, 1, 1]), np.array([1, 2, 3, 9, 0, 3]))
    assert got["id"] == [1, 2, 3, 9, 10, 13] and got["prompt"][3] == "p9"


def test_input_discovery(tmp_path):
    with pytest.raises(ConfigError, match="input.path: .*does not exist"):
        find_input_files(spec_for(tmp_path, path="nothing.parquet").input)
    with pytest.raises(ConfigError, match="input.path: no files match"):
        find_input_files(spec_for(tmp_path, path="data/*.parquet").input)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no \\*.parquet files"):
        find_input_files(spec_for(tmp_path, path="empty").input)
    write_rows(tmp_path / "data" / "b.parquet", rows([1], [None]))
    write_rows(tmp_path / "data" / "a.parquet", rows([2], [None]))
    files, root = find_input_files(spec_for(tmp_path, path="data/*.parquet").input)
    assert [os.path.basename(f) for f in files] == ["a.parquet", "b.parquet"] and root == str(tmp_path / "data")


@pytest.mark.parametrize("data, inp, needle", [
    ({"id": [1], "text": ["x"]}, {}, "input.prompt_column: column 'prompt' is missing from .*a.parquet \\(columns: id, text\\)"),
    ({"id": [1], "prompt": [3]}, {}, "input.prompt_column: column 'prompt' in .*a.parquet has type int64, expected strings"),
    ({"id": [1.5], "prompt": ["x"]}, {}, "input.id_column: column 'id' .* has type double, expected integers or strings"),
    ({"id": [1], "prompt": ["x"], "adapter": [1]}, {"adapter_column": "adapter"}, "input.adapter_column: .*expected strings"),
    ({"id": [1], "chat": [["hi"]]}, {"messages_column": "chat", "prompt_column": None},
     "input.messages_column: .*expected a list of \\{role: string, content: string\\} structs"),
    ({"id": [1], "prompt": ["x"], "max_tokens": [1.5]}, {}, "input column 'max_tokens' .* must hold integers"),
    ({"id": [1], "prompt": ["x"], "temperature": ["hot"]}, {}, "input column 'temperature' .* must hold numbers"),
])
def test_schema_errors_name_file_and_column(tmp_path, data, inp, needle):
    pq.write_table(pa.table(data), tmp_path / "a.parquet")
    spec = spec_for(tmp_path, path="a.parquet", adapters=(), **{"adapter_column": None, **inp})
    with pytest.raises(ConfigError, match=needle):
        check_schemas([str(tmp_path / "a.parquet")], spec.input)


def test_corrupt_parquet_and_mixed_id_types(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    spec = spec_for(tmp_path, path="bad.parquet", adapters=(), adapter_column=None)
    with pytest.raises(ConfigError, match="input file .*bad.parquet is not a readable Parquet file"):
        check_schemas([str(tmp_path / "bad.parquet")], spec.input)
    pq.write_table(pa.table({"id": [1], "prompt": ["a"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": ["x"], "prompt": ["a"]}), tmp_path / "b.parquet")
    with pytest.raises(ConfigError, match="integer in some files and string in others"):
        check_schemas([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], spec.input)
