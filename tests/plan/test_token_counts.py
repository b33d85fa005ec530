"""`plan`'s prompt token counts are the engine's, row by row (issue 11, start-up; issue 10 item 3):
plain text on the demo model and the tiny model, chat messages through the tiny model's chat
template; and the engine and the pre-run checks share one tokenizer loader."""
import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest

from batchrun.common import tokenizer
from batchrun.common.tokenizer import load_tokenizer
from batchrun.job.inputs import token_count
from batchrun.job.report import PY_WHITESPACE, chat_lengths, prompt_lengths
from batchrun.job.inputs.token_count import load_counter
from tests.helpers.jobs import REPO

TEXTS = ["hello world", "  leading and trailing  ", "Ünïcödé ✓ text", "a" * 300, "x", "tab\there\nnew line",
         "?!.,;:'-", "MiXeD CaSe 123", "<s>special</s> in text<sep>", "hello world", "ab  cd"]
REFUSED = [None, "", "   ", "\x1c\u3000\t", "\n"]  # rows.build_unit refuses these before tokenizing


def _models(tiny_model):
    out = [tiny_model["model"]]
    if os.path.isfile(REPO / "demo" / "model" / "tokenizer.json"):
        out.append(str(REPO / "demo" / "model"))
    return out


def _engine_lengths(model, texts):
    """What rows.build_unit gives the engine: tokenizer(list)["input_ids"]."""
    tok = load_tokenizer(model)
    return [len(ids) for ids in tok(texts)["input_ids"]]


@pytest.mark.parametrize("use_transformers", [False, True], ids=["plan", "run"])
def test_prompt_counts_equal_the_engines_row_by_row(tiny_model, use_transformers):
    for model in _models(tiny_model):
        counter = load_counter(model, messages=False, use_transformers=use_transformers)
        column = pa.array(TEXTS + REFUSED, pa.string())
        got = prompt_lengths(counter, column)
        assert got[:len(TEXTS)].tolist() == _engine_lengths(model, TEXTS), model
        assert got[len(TEXTS):].tolist() == [-1] * len(REFUSED)
        # a dictionary column and a chunked one count the same
        assert prompt_lengths(counter, column.dictionary_encode()).tolist() == got.tolist()
        chunked = pa.chunked_array([column[:4], column[4:]])
        assert prompt_lengths(counter, chunked).tolist() == got.tolist()


def test_invalid_utf8_rows_are_refused_and_the_rest_counted(tiny_model):
    raw = pa.array([b"hello", b"\xff\xfebad", None, b"world"], pa.binary()).view(pa.string())
    got = prompt_lengths(load_counter(tiny_model["model"], messages=False), raw)
    want = _engine_lengths(tiny_model["model"], ["hello", "world"])
    assert got.tolist() == [want[0], -1, -1, want[1]]


def test_whitespace_set_is_what_str_strip_removes():
    import sys
    assert PY_WHITESPACE == "".join(c for c in map(chr, range(sys.maxunicode + 1)) if c.isspace())


def test_chat_counts_equal_apply_chat_template(tiny_model):
    model = tiny_model["model"]
    counter = load_counter(model, messages=True)
    convs = [[{"role": "user", "content": "hello there"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Ünï ✓ <s>x"}],
             None, [], [{"role": "user", "content": None}],
             [{"role": "user", "content": "hello there"}]]
    column = pa.array(convs, pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    got = chat_lengths(counter, column).tolist()
    tok = load_tokenizer(model)

    def engine(msgs):
        out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return len(out["input_ids"] if hasattr(out, "keys") else out)

    assert got == [engine(convs[0]), engine(convs[1]), -1, -1, -1, engine(convs[5])]


def test_a_tokenizer_transformers_rewrites_is_counted_through_transformers(tiny_model, tmp_path):
    """tokenizer_config options that make transformers change tokenizer.json's pipeline (here
    add_eos_token) must not be counted from the raw file."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model["model"], model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_eos_token"] = True
    cfg_path.write_text(json.dumps(cfg))
    assert token_count._text_safe(str(model)) is None
    assert token_count._text_safe(tiny_model["model"]) is not None
    counter = load_counter(str(model), messages=False)
    assert counter.hf is not None  # transformers' own tokenizer, whatever it makes of the option
    assert counter.lengths(pa.array(TEXTS)).tolist() == _engine_lengths(str(model), TEXTS)


def test_one_tokenizer_per_process(tiny_model, monkeypatch):
    """The engine and the pre-run checks call the same load_tokenizer; it loads once."""
    import transformers

    from batchrun.engine import engine
    assert engine.load_tokenizer is load_tokenizer
    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    monkeypatch.setattr(tokenizer, "_loaded", {})
    model = tiny_model["model"]
    run_counter = load_counter(model, messages=False, use_transformers=True)
    assert run_counter.hf is load_tokenizer(model) is engine.load_tokenizer(model)
    assert load_counter(model, messages=True).hf is run_counter.hf
    assert len(calls) == 1


def test_counts_are_numpy_not_python_lists(tiny_model):
    out = load_counter(tiny_model["model"], messages=False).lengths(pa.array(["ab", None, "ab"]))
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out[1] == 0 and out[0] == out[2] > 0


@pytest.mark.slow
def test_plan_prompt_tokens_equal_the_runs(make_job, tmp_path):
    """End to end: the shard table's prompt tokens and error rows equal what the run records."""
    import pyarrow.parquet as pq
    from tests.helpers.jobs import demo_rows, read_output, run_cli
    rows = demo_rows(20)
    rows[3]["prompt"] = "a" * 120  # too long with max_tokens 24 in max_model_len 128: an error row
    rows[4]["prompt"] = "   "      # empty
    rows[5]["prompt"] = "<s>hello</s>"
    job = make_job(rows)
    plan = run_cli("plan", job)
    assert plan.returncode == 0, plan.stderr
    run = run_cli("run", job)
    assert run.returncode == 0, run.stderr
    out = read_output(tmp_path / "out").to_pylist()
    for shard, adapter in (("base", None), ("reverse", "reverse"), ("upper", "upper")):
        mine = [r for r in out if r["adapter"] == adapter]
        line = next(ln.split() for ln in plan.stdout.splitlines() if ln.split()[:1] == [shard])
        assert int(line[1]) == len(mine)
        assert int(line[2]) == sum(r["prompt_tokens"] for r in mine), (shard, plan.stdout)
        assert int(line[4]) == sum(r["finish_reason"] == "error" for r in mine), (shard, plan.stdout)
