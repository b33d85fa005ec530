"""RequestOutput.prompt / prompt_token_ids, the progress bar, lora_request, and the warning when
the model's generation_config.json sets sampling defaults."""
import json
import logging
import shutil
from pathlib import Path

import pytest

import batchrun
from batchrun.errors import ConfigError

DEMO = Path(__file__).resolve().parent.parent.parent / "demo"


def test_request_output_carries_the_prompt_and_its_token_ids(demo_llm):
    ids = [1, 8, 9, 4]
    out = demo_llm.generate(["hello world", ids, {"prompt_token_ids": ids}], {"max_tokens": 4}, use_tqdm=False)
    assert out[0].prompt == "hello world"
    assert out[0].prompt_token_ids == demo_llm.tokenizer("hello world")["input_ids"]
    assert (out[1].prompt, out[1].prompt_token_ids) == (None, ids) and out[2].prompt_token_ids == ids
    assert [o.request_id for o in out] == [0, 1, 2] and all(o.finished for o in out)
    assert out[0].outputs[0].cumulative_logprob is None  # as vLLM: only with logprobs requested


def test_logprobs_in_vllms_form(demo_llm):
    tok = demo_llm.tokenizer
    greedy = demo_llm.generate("hello world", {"max_tokens": 6, "logprobs": 2}, use_tqdm=False)[0].outputs[0]
    for t, d, top in zip(greedy.token_ids, greedy.logprobs, greedy.top_logprobs):
        assert list(d) == [tid for tid, _ in top] and [p.rank for p in d.values()] == [1, 2]
        assert d[t].rank == 1 and d[t].logprob == top[0][1] and d[t].decoded_token == tok.decode([t])
    sampled = demo_llm.generate("hello world", {"max_tokens": 16, "logprobs": 0, "temperature": 2.0, "n": 4},
                                use_tqdm=False)[0].outputs
    for c in sampled:  # logprobs=0: the sampled token alone, its rank not computed
        assert all(list(d) == [t] and d[t].rank is None for t, d in zip(c.token_ids, c.logprobs))
        assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))


def test_progress_bar_by_default_and_off_by_flag(demo_llm, capsys):
    demo_llm.generate(["hello", "fox", ""], {"max_tokens": 4})
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err
    demo_llm.generate(["hello"], {"max_tokens": 4}, use_tqdm=False)
    assert capsys.readouterr().err == ""
    seen = []

    class Bar:  # a tqdm-like factory, as vLLM's use_tqdm takes
        def __init__(self, **kw):
            seen.append(("total", kw["total"]))

        def update(self, k):
            seen.append(("update", k))

        def close(self):
            seen.append(("close",))
    demo_llm.generate(["hello", ""], {"max_tokens": 4, "n": 2, "temperature": 1.0}, use_tqdm=Bar)
    assert seen == [("total", 2), ("update", 1), ("update", 1), ("close",)]  # the error prompt counts at once


def test_lora_request_names_a_configured_adapter(demo_llm):
    path = str(DEMO / "adapters" / "upper")
    by_name = demo_llm.generate(["fox", "fox"], {"max_tokens": 8}, adapters=[None, "upper"], use_tqdm=False)
    by_req = demo_llm.generate(["fox", "fox"], {"max_tokens": 8}, use_tqdm=False,
                               lora_request=[None, batchrun.LoRARequest("upper", 1, path)])
    assert [o.outputs[0].text for o in by_req] == [o.outputs[0].text for o in by_name] == ["fox", "FOX"]
    assert by_req[1].adapter == "upper"
    with pytest.raises(ConfigError, match="adapter 'upper' has path /elsewhere, but this LLM loaded"):
        demo_llm.generate("fox", lora_request=batchrun.LoRARequest("upper", 1, "/elsewhere"), use_tqdm=False)
    with pytest.raises(ConfigError, match=r"adapter 'other' \(/x\) was not given to this LLM"):
        demo_llm.generate("fox", lora_request=batchrun.LoRARequest("other", 2, "/x"), use_tqdm=False)
    with pytest.raises(ConfigError, match="adapters and lora_request both given"):
        demo_llm.generate("fox", adapters="upper", lora_request="upper", use_tqdm=False)
    unknown = demo_llm.generate("fox", lora_request="nope", use_tqdm=False)[0]  # as a job row: an error output
    assert "unknown adapter 'nope'" in unknown.error


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("gc") / "model"
    shutil.copytree(DEMO / "model", d)
    gc = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gc, "temperature": 0.7, "top_p": 0.8, "do_sample": True}))
    return d


def test_generation_config_defaults_are_logged_once(warm_model, caplog):
    llm = batchrun.LLM(warm_model, device="cpu", max_model_len=128)
    with caplog.at_level(logging.WARNING, logger="batchrun"):
        llm.generate("hello", {"max_tokens": 4}, use_tqdm=False)
        llm.generate("hello", batchrun.SamplingParams(max_tokens=8), use_tqdm=False)
    said = [r.getMessage() for r in caplog.records if r.name == "batchrun"]
    assert len(said) == 1 and "generation_config.json" in said[0] and "temperature=0.7, top_p=0.8" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchrun"):
        llm.generate("hello", batchrun.SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    said = [r.getMessage() for r in caplog.records if r.name == "batchrun"]
    assert len(said) == 1 and "sets top_p=0.8 for" in said[0]  # temperature given: only top_p applied


def test_a_short_max_model_len_is_not_refused_at_start():
    llm = batchrun.LLM(DEMO / "model", device="cpu", max_model_len=32)
    assert llm.generate("hello", {"max_tokens": 8}, use_tqdm=False)[0].outputs[0].text == "hello"
    with pytest.raises(ConfigError, match="sampling.max_tokens: must be smaller than engine.max_model_len"):
        llm.generate("hello", {"max_tokens": 32}, use_tqdm=False)
