"""sampling.response_format through xgrammar (optional extra): constrained rows parse and validate,
unconstrained rows in the same job are unchanged, bad formats are config errors or error rows,
and a missing xgrammar is a clear error."""
import json
import re
import string
import sys

import pytest

from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import load_job, parse_job
from batchrun.job.run.runner import run_job
from tests.helpers.jobs import read_output, write_job, write_rows

SCHEMA = {"type": "object", "properties": {"name": {"enum": ["ann", "bob"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "ok", "n"], "additionalProperties": False}


def test_format_shapes_are_checked_in_the_job_file():
    base = {"model": "m", "input": {"path": "x"}, "output": {"path": "o"}}
    for fmt, needle in [({"type": "xml"}, "type must be one of json_schema, json_object, regex"),
                        ({"type": "json_schema"}, "type json_schema needs schema"),
                        ({"type": "regex", "pattern": ""}, "type regex needs pattern"),
                        ({"type": "json_object", "schema": {}}, "unknown key 'schema' for type json_object")]:
        with pytest.raises(ConfigError) as e:
            parse_job({**base, "sampling": {"response_format": fmt}}, base_dir="/j")
        assert f"sampling.response_format: {needle}" in str(e.value)


def test_missing_xgrammar_is_a_clear_error(monkeypatch):
    from batchrun.engine.grammar import _xgrammar
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import raises ImportError
    with pytest.raises(ConfigError, match="needs the optional package xgrammar"):
        _xgrammar()


@pytest.fixture(scope="module")
def json_model(tmp_path_factory):
    pytest.importorskip("xgrammar")
    from tests.helpers.models import save_hf_model
    from tests.helpers.tokenizer import char_tokenizer
    d = tmp_path_factory.mktemp("jsonllama") / "model"
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = char_tokenizer(string.printable[:95], specials, wrap=False, chat_template=None)
    save_hf_model("char_llama", d, tokenizer=tok, over={"vocab_size": len(specials) + 95})
    return str(d)


def _job(tmp_path, model, rows, name, device="cpu", **sampling):
    write_rows(tmp_path / name / "in.parquet", rows)
    return write_job(tmp_path / f"{name}.yaml", {
        "model": model, "input": {"path": f"{name}/in.parquet", "id_column": "id", "rows_per_unit": 4},
        "output": {"path": f"{name}-out"}, "sampling": {"max_tokens": 60, "temperature": 1.0, **sampling},
        "engine": {"device": device, "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8}})


def _run(job):
    return run_job(load_job(job), progress=False, log=lambda m: None)


def test_constrained_rows_validate_and_others_are_unchanged(json_model, tmp_path):
    _check_constrained_job(json_model, tmp_path, "cpu")


@pytest.mark.gpu
def test_constrained_rows_on_cuda(json_model, tmp_path):
    """The same job on CUDA (float32 of the saved model; decode steps from the graph sets): the
    mask is applied to the GPU logits of constrained rows only."""
    _check_constrained_job(json_model, tmp_path, "cuda")


def _check_constrained_job(json_model, tmp_path, device):
    jsonschema = pytest.importorskip("jsonschema")
    fmt = json.dumps({"type": "json_schema", "schema": SCHEMA})
    regex = json.dumps({"type": "regex", "pattern": "[a-c]{3}-[0-9]{2}"})
    rows = [{"id": i, "prompt": f"row {i}", "response_format": [fmt, None, regex][i % 3]} for i in range(12)]
    _run(_job(tmp_path, json_model, rows, "mixed", device))
    plain = [{"id": r["id"], "prompt": r["prompt"]} for r in rows]
    _run(_job(tmp_path, json_model, plain, "plain", device))
    got = {r["id"]: r for r in read_output(tmp_path / "mixed-out").to_pylist()}
    ref = {r["id"]: r for r in read_output(tmp_path / "plain-out").to_pylist()}
    for i in range(12):
        r = got[i]
        assert r["error"] is None, r["error"]
        if i % 3 == 0:
            assert r["finish_reason"] == "stop"
            jsonschema.validate(json.loads(r["output_text"]), SCHEMA)
        elif i % 3 == 2:
            assert re.fullmatch("[a-c]{3}-[0-9]{2}", r["output_text"]), r["output_text"]
        else:
            assert r["output_token_ids"] == ref[i]["output_token_ids"]
    assert any(got[i]["output_token_ids"] != ref[i]["output_token_ids"] for i in range(0, 12, 3))


def test_bad_formats(json_model, tmp_path):
    bad_job = _job(tmp_path, json_model, [{"id": 0, "prompt": "x"}], "badjob",
                   response_format={"type": "json_schema", "schema": {"type": "nonsense"}})
    with pytest.raises(ConfigError, match='sampling.response_format \\(json_schema\\) does not compile: .*nonsense'):
        _run(bad_job)
    rows = [{"id": 0, "prompt": "x", "response_format": '{"type": "regex", "pattern": "([a-"}'},
            {"id": 1, "prompt": "y", "response_format": "{not json"},
            {"id": 2, "prompt": "z", "response_format": None}]
    _run(_job(tmp_path, json_model, rows, "badrows"))
    got = {r["id"]: r for r in read_output(tmp_path / "badrows-out").to_pylist()}
    assert "response_format (regex) does not compile" in got[0]["error"]
    assert "response_format is not valid JSON" in got[1]["error"]
    assert got[2]["error"] is None
