"""`batchrun plan` says what the run will do: error rows it can predict (per-row overrides that the
run refuses, unknown adapters), the response_format, the LoRA slots the engine will have, and a
device the run would refuse."""
import json

import pytest
from click.testing import CliRunner

from batchrun.cli import ExitCode, main
from tests.helpers.jobs import demo_rows


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def error_rows(output: str) -> dict[str, int]:
    lines = output.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("shard"))
    table = {}
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith(("predicted", "(")):
            break
        name = line.rsplit(None, 4)[0]
        table[name] = int(line.split()[-1])
    return table


SCHEMA_OK = json.dumps({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}})
SCHEMA_BAD = json.dumps({"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}})
REGEX_BAD = json.dumps({"type": "regex", "pattern": "(unclosed"})


def test_per_row_formats_that_do_not_compile_are_predicted_error_rows(make_job):
    pytest.importorskip("xgrammar")
    rows = demo_rows(9)
    for r in rows:
        r["adapter"] = None
        r["response_format"] = SCHEMA_OK
    rows[1]["response_format"] = SCHEMA_BAD  # valid shape, does not compile
    rows[2]["response_format"] = REGEX_BAD
    rows[3]["response_format"] = "not json"  # refused before the engine (already predicted)
    rows[4]["temperature"] = -1.0
    for r in rows:
        r.setdefault("temperature", None)
    r = cli("plan", make_job(rows))
    assert r.exit_code == 0, r.output
    assert error_rows(r.output) == {"base": 4}


def test_unknown_adapters_are_predicted_error_rows(make_job):
    rows = demo_rows(6)
    rows[0]["adapter"] = rows[3]["adapter"] = "missing"
    r = cli("plan", make_job(rows))
    assert r.exit_code == 0, r.output
    assert error_rows(r.output)["missing (unknown)"] == 2


def test_plan_prints_the_job_response_format(make_job):
    pytest.importorskip("xgrammar")
    r = cli("plan", make_job(demo_rows(3), sampling={"max_tokens": 24, "response_format": {"type": "json_object"}}))
    assert r.exit_code == 0, r.output
    assert '          response_format={"type": "json_object"}\n' in r.output


def test_plan_prints_the_lora_slots_the_run_will_use(make_job):
    r = cli("plan", make_job(demo_rows(6)))  # two adapters, engine.max_loras default 4
    assert "max_loras=2 (engine.max_loras 4, 2 adapter(s) configured)" in r.output, r.output
    assert "max_loras=4" not in r.output
    r = cli("plan", make_job(demo_rows(6), engine={"max_loras": 1}))
    assert "max_model_len=128, max_loras=1\n" in r.output
    rows = [{**x, "adapter": None} for x in demo_rows(6)]
    r = cli("plan", make_job(rows, adapters=None, input={"adapter_column": None}))
    assert r.exit_code == 0, r.output
    assert "max_loras=0 (no adapters: LoRA is off)" in r.output


def test_plan_refuses_device_cuda_without_a_gpu(make_job):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = cli("plan", make_job(demo_rows(3), engine={"device": "cuda"}))
    assert r.exit_code == ExitCode.CONFIG, r.output
    assert "engine.device: 'cuda' asked for but no CUDA GPU is visible" in r.output


def test_plan_says_when_the_run_will_exit_10(make_job):
    rows = demo_rows(6)
    for r in rows:
        r["adapter"] = "missing"
    r = cli("plan", make_job(rows))
    assert "predicted error rows: 6 of 6 output rows (100.00 %): every row, so the run will exit 10" in r.output, r.output
    rows = demo_rows(6)
    rows[2]["prompt"] = ""
    r = cli("plan", make_job(rows, max_error_rate=0.5))
    assert "predicted error rows: 1 of 6 output rows (16.67 %); within max_error_rate 0.5" in r.output
    r = cli("plan", make_job(rows, max_error_rate=0.1))
    assert "(16.67 %): more than max_error_rate 0.1, so the run will exit 10" in r.output


def test_plan_predicts_what_the_real_engine_refuses(make_job, tmp_path):
    """The real engine (CPU, tiny model) on the same rows: its error rows are the ones plan counted."""
    pytest.importorskip("xgrammar")
    from tests.helpers.jobs import read_output
    rows = demo_rows(6)
    for r in rows:
        r["adapter"] = None
        r["response_format"] = SCHEMA_OK
    rows[1]["response_format"] = SCHEMA_BAD
    rows[2]["response_format"] = REGEX_BAD
    job = make_job(rows, sampling={"max_tokens": 4})
    assert error_rows(cli("plan", job).output) == {"base": 2}
    r = cli("run", job, "--no-progress")
    assert r.exit_code == 0, r.output
    out = read_output(tmp_path / "out").to_pylist()
    assert sorted(x["id"] for x in out if x["finish_reason"] == "error") == [1, 2]
    assert all("does not compile" in x["error"] for x in out if x["finish_reason"] == "error")
