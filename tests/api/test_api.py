"""batchrun.run and batchrun.LLM: the same validation, engine and row builder as the CLI."""
from pathlib import Path

import pytest

import batchrun
from batchrun.errors import ConfigError
from tests.helpers.jobs import read_output, write_rows

DEMO = Path(__file__).resolve().parent.parent.parent / "demo"


@pytest.fixture
def llm(demo_llm):
    return demo_llm


def test_generate_text_ids_messages_and_adapters(llm):
    ids = llm.tokenizer("hello world")["input_ids"]
    out = llm.generate(["hello world", ids, "fox"], {"max_tokens": 16}, adapters=[None, None, "upper"])
    assert [o.outputs[0].text for o in out] == ["hello world", "hello world", "FOX"]
    assert out[1].prompt_tokens == len(ids) and out[0].outputs[0].finish_reason == "stop"
    assert out[2].adapter == "upper"


def test_generate_n_logprobs_stop_and_errors(llm):
    out = llm.generate(["hello world", ""], {"max_tokens": 16, "n": 3, "temperature": 1.0, "logprobs": 2,
                                             "stop": ["wor"]})
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    again = llm.generate(["hello world"], {"max_tokens": 16, "n": 3, "temperature": 1.0, "logprobs": 2,
                                           "stop": ["wor"]})
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in out[0].outputs]
    assert all(len(c.logprobs) == len(c.token_ids) for c in out[0].outputs)
    assert out[1].error and "prompt is empty" in out[1].error
    greedy = llm.generate("hello world", {"max_tokens": 16, "stop": "wor"})[0].outputs[0]
    assert (greedy.text, greedy.stop_reason) == ("hello ", "wor")


def test_bad_values_are_the_job_file_errors(llm):
    with pytest.raises(ConfigError, match="sampling.top_p: must be in"):
        llm.generate(["x"], {"top_p": 0})
    with pytest.raises(ConfigError, match="engine.max_model_len: must be >= 1"):
        batchrun.LLM(DEMO / "model", max_model_len=0)


def test_run_takes_a_dict(tmp_path, monkeypatch):
    write_rows(tmp_path / "in.parquet", [{"id": i, "prompt": p} for i, p in enumerate(["hello", "fox"])])
    monkeypatch.chdir(tmp_path)
    stats = batchrun.run({"model": str(DEMO / "model"), "input": {"path": "in.parquet", "id_column": "id"},
                          "output": {"path": "out"}, "sampling": {"max_tokens": 8},
                          "engine": {"device": "cpu", "max_model_len": 128}})
    assert stats.status == "done" and stats.output_rows == 2
    assert sorted(read_output(tmp_path / "out").column("output_text").to_pylist()) == ["fox", "hello"]
