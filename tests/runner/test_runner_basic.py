"""Runner logic with the FakeEngine (same API as the real one): outputs, bad rows, resume,
fingerprints, tasks, metrics. The real engine is exercised in test_runner_e2e.py."""
import json
import os

import pyarrow as pa
import pytest

from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import load_job
from batchrun.job.plan.prepare import JobChanged
from batchrun.job.run.runner import RowFailure, run_job
from batchrun.job.inputs.rows import row_seed
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, expected, read_output, write_rows


def run(job, **kw):
    kw.setdefault("engine_factory", FakeEngine.from_spec)
    return run_job(load_job(job), progress=False, log=lambda m: None, **kw)


def by_id(table: pa.Table) -> dict:
    return {r["id"]: r for r in table.to_pylist()}


def test_outputs_every_row_once_with_expected_text(make_job, tmp_path):
    rows = demo_rows(30)
    stats = run(make_job(rows))
    assert (stats.units_done, stats.output_rows, stats.error_rows, stats.status) == (9, 30, 0, "done")
    table = read_output(tmp_path / "out")
    assert table.schema.names == ["id", "adapter", "output_text", "output_token_ids", "prompt_tokens",
                                  "output_tokens", "finish_reason", "error"]
    assert table.schema.field("output_token_ids").type == pa.list_(pa.int32())
    got = by_id(table)
    assert sorted(got) == list(range(30)) and table.num_rows == 30
    for r in rows:
        o = got[r["id"]]
        assert o["output_text"] == expected(r["prompt"], r["adapter"])
        assert (o["adapter"], o["finish_reason"], o["error"]) == (r["adapter"], "stop", None)
        assert o["output_tokens"] == len(o["output_token_ids"]) == len(r["prompt"])
        assert o["prompt_tokens"] == len(r["prompt"]) + 2  # <s> ... <sep>
    files = sorted(os.listdir(tmp_path / "out"))
    assert files == ["_batchrun"] + [f"part-{i:06d}.parquet" for i in range(9)]
    metrics = json.loads((tmp_path / "out" / "_batchrun" / "metrics.json").read_text())
    assert metrics["complete"] and metrics["rows_committed"] == 30 and metrics["units_committed"] == 9
    assert metrics["tasks"]["task-0"]["status"] == "done"
    assert os.listdir(tmp_path / "out" / "_batchrun" / "tmp") == []


def test_base_shard_runs_first_and_units_are_batched(make_job, tmp_path, monkeypatch):
    log = tmp_path / "results.txt"
    monkeypatch.setenv("FAKE_ENGINE_LOG", str(log))
    monkeypatch.setattr(FakeEngine, "max_units_in_flight", 0)
    run(make_job(demo_rows(30)))
    # 3 shards of 10 rows (units of 4, 4, 2), base first: the fake finishes requests in the
    # order the runner hands them over, so every base row comes before any adapter row
    adapters = [line.split()[-1] for line in log.read_text().splitlines()]
    assert adapters == ["None"] * 10 + ["reverse"] * 10 + ["upper"] * 10
    assert FakeEngine.max_units_in_flight > 1  # the engine's batch holds rows of several units
    commits = sorted((tmp_path / "out" / "_batchrun" / "commits").iterdir())
    adapters = [json.loads(c.read_text())["adapter"] for c in commits]
    assert adapters == [None] * 3 + ["reverse"] * 3 + ["upper"] * 3


def test_bad_rows_become_error_rows(make_job, tmp_path):
    rows = [
        {"id": 1, "prompt": "fine", "adapter": None, "max_tokens": None},
        {"id": 2, "prompt": "", "adapter": None, "max_tokens": None},
        {"id": 3, "prompt": "   ", "adapter": "reverse", "max_tokens": None},
        {"id": 4, "prompt": None, "adapter": None, "max_tokens": None},
        {"id": 5, "prompt": "x" * 120, "adapter": None, "max_tokens": None},
        {"id": 6, "prompt": "abc", "adapter": "nosuch", "max_tokens": None},
        {"id": 7, "prompt": "abc", "adapter": "upper", "max_tokens": 0},
        {"id": 8, "prompt": "hello world", "adapter": "reverse", "max_tokens": 3},
        {"id": 9, "prompt": "x" * 100, "adapter": None, "max_tokens": 2},
    ]
    stats = run(make_job(rows))
    got = by_id(read_output(tmp_path / "out"))
    assert sorted(got) == list(range(1, 10))
    assert stats.error_rows == 6

    def error(i):
        assert got[i]["finish_reason"] == "error" and got[i]["output_text"] is None
        assert got[i]["output_token_ids"] == [] and got[i]["output_tokens"] == 0
        return got[i]["error"]

    assert error(2) == "prompt is empty (column 'prompt')"
    assert error(3) == "prompt is empty (column 'prompt')"
    assert error(4) == "prompt is null (column 'prompt')"
    assert error(5) == "prompt has 122 tokens; with max_tokens 24 that exceeds engine.max_model_len 128"
    assert got[5]["prompt_tokens"] == 122
    assert error(6) == "unknown adapter 'nosuch' (configured adapters: reverse, upper)"
    assert got[6]["adapter"] == "nosuch"
    assert error(7).startswith("bad per-row sampling override: max_tokens must be an integer >= 1")
    assert got[1]["output_text"] == "fine" and got[1]["error"] is None
    assert (got[8]["output_text"], got[8]["finish_reason"]) == ("dlr", "length")  # per-row max_tokens
    assert got[9]["finish_reason"] == "length"  # 102 + 2 fits where 102 + 24 would not


def test_on_error_fail_stops_with_row_id_and_keeps_committed_units(make_job, tmp_path):
    rows = demo_rows(12)
    rows[7]["prompt"] = ""  # adapter reverse (7 % 3 == 1): after the base shard
    with pytest.raises(RowFailure, match=r"row id=7: prompt is empty .*\(on_error: fail\)"):
        run(make_job(rows, on_error="fail"))
    done = sorted(os.listdir(tmp_path / "out" / "_batchrun" / "commits"))
    assert done == ["unit-000000.json"]  # the base shard (4 rows) was committed before the bad unit
    assert {r["id"] for r in read_output(tmp_path / "out").to_pylist()} == {0, 3, 6, 9}


def test_on_error_fail_with_unknown_adapter_fails_before_model_load(make_job):
    rows = demo_rows(6)
    rows[4]["adapter"] = "mystery"
    with pytest.raises(RowFailure, match=r"1 row\(s\) name adapters that are not configured \('mystery'; "
                                         r"configured: reverse, upper\)"):
        run(make_job(rows, on_error="fail"), engine_factory=never_load)


def test_rerun_skips_committed_units(make_job, tmp_path):
    job = make_job(demo_rows(30))
    run(job)
    mtimes = {p: os.stat(tmp_path / "out" / p).st_mtime_ns for p in os.listdir(tmp_path / "out") if p.startswith("part-")}
    stats = run(job)
    assert (stats.units_skipped, stats.units_done, stats.output_rows) == (9, 0, 0)
    assert {p: os.stat(tmp_path / "out" / p).st_mtime_ns for p in mtimes} == mtimes
    assert read_output(tmp_path / "out").num_rows == 30


def test_changed_job_is_refused_unless_restart(make_job, tmp_path):
    run(make_job(demo_rows(12)))
    with pytest.raises(JobChanged, match=r"holds results of a different job \(changed: the sampling settings.*"
                                         r"Rerun with --restart"):
        run(make_job(demo_rows(12), sampling={"max_tokens": 5}))
    with pytest.raises(JobChanged, match="the input files"):
        run(make_job(demo_rows(13)))
    stats = run(make_job(demo_rows(13)), restart=True)
    assert stats.units_skipped == 0 and read_output(tmp_path / "out").num_rows == 13
    # performance-only settings may change between a crash and the rerun
    stats = run(make_job(demo_rows(13), engine={"max_num_seqs": 2, "max_loras": 1}))
    assert stats.units_skipped == stats.units_total


def test_two_tasks_write_disjoint_units_covering_every_row(make_job, tmp_path):
    # Units are claimed dynamically (#14): two tasks running at once share them; one task alone
    # runs everything, so the second one, started after, has nothing left.
    from tests.helpers.faults import assert_every_id_once
    from tests.helpers.jobs import fork_cli
    # A worker's feeder claims only 2 x max_num_seqs rows (+ one unit) ahead of its engine, so
    # the other worker, starting a moment later, still finds units.
    job = make_job(demo_rows(120), engine={"max_num_seqs": 2})
    procs = [fork_cli(["run", job, "--no-progress", "--task-id", t, "--num-tasks", 2],
                      env={"FAKE_ENGINE_SLEEP": "0.03", "BATCHRUN_CLAIM_LEASE": "2"})
             for t in (0, 1)]
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    commits = [json.loads(p.read_text()) for p in (tmp_path / "out" / "_batchrun" / "commits").iterdir()]
    by_task = {t: {c["unit"] for c in commits if c["task"] == t} for t in (0, 1)}
    assert by_task[0] and by_task[1] and len(commits) == 30
    assert by_task[0].isdisjoint(by_task[1]) and by_task[0] | by_task[1] == set(range(30))
    assert 0 in by_task[0] and 15 in by_task[1]  # each starts at its share of the --num-tasks hint
    assert_every_id_once(tmp_path / "out", n_rows=120)
    metrics = json.loads((tmp_path / "out" / "_batchrun" / "metrics.json").read_text())
    assert set(metrics["tasks"]) == {"task-0", "task-1"} and metrics["complete"]
    assert os.listdir(tmp_path / "out" / "_batchrun" / "claims") == []  # every claim released
    later = run(job, task_id=1, num_tasks=2)
    assert (later.units_done, later.units_skipped, later.units_total) == (0, 30, 30)


def test_task_id_out_of_range(make_job):
    with pytest.raises(ConfigError, match=r"--task-id must be in \[0, 2\)"):
        run(make_job(demo_rows(3)), task_id=2, num_tasks=2)


def test_default_ids_and_chat_messages(make_job, tmp_path):
    chats = [{"chat": [{"role": "user", "content": "hello"}, {"role": "user", "content": " fox"}]},
             {"chat": []}, {"chat": None}]
    job = make_job(chats, input={"id_column": None, "prompt_column": None, "messages_column": "chat",
                                 "adapter_column": None}, adapters=None)
    run(job)
    got = by_id(read_output(tmp_path / "out"))
    assert set(got) == {"in.parquet:0", "in.parquet:1", "in.parquet:2"}
    assert got["in.parquet:0"]["output_text"] == "hello fox"
    assert got["in.parquet:1"]["error"] == "messages are empty (column 'chat')"
    assert got["in.parquet:2"]["error"] == "messages are null (column 'chat')"


def test_row_seeds_are_stable_and_distinct():
    assert row_seed(0, 5) == row_seed(0, 5)
    assert len({row_seed(0, i) for i in range(1000)}) == 1000
    assert row_seed(1, 5) != row_seed(0, 5)
    assert row_seed(0, "5") != row_seed(0, 5)


def never_load(spec):
    raise AssertionError("the model must not be loaded for a bad configuration")


@pytest.mark.parametrize("case, needle", [
    ("missing_column", r"input.prompt_column: column 'prompt' is missing from .*in.parquet"),
    ("wrong_type", r"input.prompt_column: column 'prompt' in .*in.parquet has type int64, expected strings"),
    ("corrupt_parquet", r"input file .*in.parquet is not a readable Parquet file"),
    ("no_model", r"model: .*nowhere is not a directory"),
    ("model_no_config", r"model: .* has no config.json"),
    ("bad_weights", r"model: .*model.safetensors"),
    ("no_adapter", r"adapters.reverse: .*gone is not a directory"),
    ("adapter_no_config", r"adapters.reverse: .* has no adapter_config.json"),
    ("adapter_rank_too_big", r"adapters.reverse: .*rank"),
    ("unwritable_output", r"output.path: cannot write to .*afile/out"),
    ("duplicate_ids", r"input.id_column: 1 id\(s\) in column 'id' appear more than once"),
    ("no_chat_template", r"input.messages_column: the tokenizer in .* has no chat template"),
])
def test_bad_config_fails_before_model_load(make_job, tmp_path, tiny_model, case, needle):
    import shutil
    rows, over = demo_rows(6), {}
    model = tmp_path / "model"
    shutil.copytree(tiny_model["model"], model)
    over["model"] = str(model)
    if case == "missing_column":
        rows = [{"id": 1, "text": "a", "adapter": None}]
    elif case == "wrong_type":
        rows = [{"id": 1, "prompt": 5, "adapter": None}]
    elif case == "no_model":
        over["model"] = str(tmp_path / "nowhere")
    elif case == "model_no_config":
        os.remove(model / "config.json")
    elif case == "bad_weights":
        (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    elif case == "no_adapter":
        over["adapters"] = {"reverse": str(tmp_path / "gone")}
    elif case == "adapter_no_config":
        (tmp_path / "empty_adapter").mkdir()
        over["adapters"] = {"reverse": str(tmp_path / "empty_adapter")}
    elif case == "adapter_rank_too_big":
        over["engine"] = {"max_lora_rank": 2}  # the adapters have rank 4
    elif case == "unwritable_output":
        (tmp_path / "afile").write_text("a file, not a directory")
        over["output"] = {"path": "afile/out"}
    elif case == "duplicate_ids":
        rows[3]["id"] = rows[1]["id"]
    elif case == "no_chat_template":
        os.remove(model / "chat_template.jinja")
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (model / "tokenizer_config.json").write_text(json.dumps(cfg))
        rows = [{"id": 1, "chat": [{"role": "user", "content": "a"}]}]
        over["input"] = {"prompt_column": None, "messages_column": "chat", "adapter_column": None}
        over["adapters"] = None
    job = make_job(rows, **over)
    if case == "corrupt_parquet":
        (tmp_path / "data" / "in.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(ConfigError, match=needle):
        run(job, engine_factory=never_load)
    if case not in ("unwritable_output",):
        assert not (tmp_path / "out" / "part-000000.parquet").exists()
