"""input.prompt_token_ids_column (no tokenizer), system_prompt, chat_template_kwargs,
add_special_tokens: the prompt ids each builds, and the job-file errors."""
import json
import shutil

import pytest
import torch

from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import load_job, parse_job
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import read_output
from tests.helpers.models import hf_greedy, save_hf_model


def run(job, fake=True):
    kw = {"engine_factory": FakeEngine.from_spec} if fake else {}
    return run_job(load_job(job), progress=False, log=lambda m: None, **kw)


def test_token_id_prompts_need_no_tokenizer(job_factory, tmp_path):
    d = tmp_path / "notok"
    hf = save_hf_model("llama_mha", d, seed=1)
    prompts = [[5, 9, 33, 7], [100, 3], [17] * 6]
    job = job_factory([{"id": i, "ids": p} for i, p in enumerate(prompts)], model=str(d),
                      input={"prompt_column": None, "prompt_token_ids_column": "ids"},
                      sampling={"max_tokens": 6, "ignore_eos": True})
    run(job, fake=False)
    out = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    for i, p in enumerate(prompts):
        assert out[i]["output_token_ids"] == hf_greedy(hf, p, 6)
        assert out[i]["prompt_tokens"] == len(p) and out[i]["output_text"] is None


def test_system_prompt_renders_through_the_chat_template(job_factory, tmp_path, char_model):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(char_model)
    rows = [{"id": 0, "prompt": "hello"}, {"id": 1, "prompt": "abc"}]
    run(job_factory(rows, input={"system_prompt": "Be brief. "}, sampling={"max_tokens": 30}))
    out = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    for r in rows:  # the fake engine echoes the prompt it got
        msgs = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": r["prompt"]}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert out[r["id"]]["output_text"] == "Be brief. " + r["prompt"]
        assert out[r["id"]]["prompt_tokens"] == len(ids) == len("Be brief. ") + len(r["prompt"])  # auto: no BOS


def test_add_special_tokens_false_and_true(job_factory, tmp_path):
    rows = [{"id": 0, "prompt": "hello"}]
    run(job_factory(rows, input={"add_special_tokens": False}, output={"path": "a"}, job_name="a.yaml"))
    run(job_factory(rows, output={"path": "b"}, job_name="b.yaml"))
    run(job_factory(rows, input={"system_prompt": "x", "add_special_tokens": True}, output={"path": "c"},
                    job_name="c.yaml"))
    n = lambda d: read_output(tmp_path / d).column("prompt_tokens").to_pylist()[0]
    assert (n("a"), n("b"), n("c")) == (5, 7, 8)  # <s> ... <sep> from the tokenizer's post-processor


def test_chat_template_kwargs_reach_the_template(job_factory, tmp_path, char_model):
    d = tmp_path / "kwmodel"
    shutil.copytree(char_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    for f in d.glob("chat_template.*"):
        f.unlink()
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rows = [{"id": 0, "messages": [{"role": "user", "content": "hi"}]}]
    run(job_factory(rows, model=str(d), input={"prompt_column": None, "messages_column": "messages",
                                               "chat_template_kwargs": {"shout": True}}))
    assert read_output(tmp_path / "out").column("output_text").to_pylist() == ["hi!!"]


@pytest.mark.parametrize("inp, needle", [
    ({"prompt_token_ids_column": "ids"}, "set one of prompt_column (text), messages_column"),
    ({"prompt_column": None, "prompt_token_ids_column": "ids", "system_prompt": "x"},
     "input.system_prompt: has no effect with prompt_token_ids_column"),
    ({"add_special_tokens": "yes"}, "input.add_special_tokens: expected auto, true or false"),
    ({"system_prompt": " "}, "input.system_prompt: must not be empty"),
])
def test_input_errors(inp, needle):
    with pytest.raises(ConfigError) as e:
        parse_job({"model": "m", "input": {"path": "x", "prompt_column": "p", **inp}, "output": {"path": "o"}},
                  base_dir="/j")
    assert needle in str(e.value)


def test_plan_counts_token_id_prompts_and_system_prompts(job_factory, tmp_path):
    from batchrun.job.report import plan_report
    d = tmp_path / "notok"
    save_hf_model("llama_mha", d, seed=1)
    job = job_factory([{"id": 0, "ids": [5, 6, 7]}, {"id": 1, "ids": [9] * 200}], model=str(d),
                      input={"prompt_column": None, "prompt_token_ids_column": "ids"}, job_name="ids.yaml")
    text = plan_report(load_job(job), 1)
    assert _row(text) == ["base", "2", "203", "1", "1"], text  # 200 + 10 > max_model_len 128
    sysjob = job_factory([{"id": 0, "prompt": "abc"}], input={"system_prompt": "Be brief. "}, job_name="s.yaml")
    assert _row(plan_report(load_job(sysjob), 1)) == ["base", "1", "13", "1", "0"]


def _row(text):
    return next(line.split() for line in text.splitlines() if line.startswith("base "))
