"""batchrun.SamplingParams: vLLM's field names over job.yaml's sampling fields, one or one per
prompt; vLLM fields batchrun does not implement are refused, never ignored."""
import pytest

import batchrun
from batchrun.errors import ConfigError


def test_vllm_names_give_the_dict_forms_tokens(demo_llm):
    fields = {"max_tokens": 16, "n": 3, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 5,
              "logprobs": 2, "stop": ["wor"], "include_stop_str_in_output": True, "presence_penalty": 0.5}
    sp = batchrun.SamplingParams(**fields)
    got = demo_llm.generate(["hello world", "fox"], sp, use_tqdm=False)
    want = demo_llm.generate(["hello world", "fox"], fields, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert [len(o.outputs) for o in got] == [3, 3]
    c = got[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids)
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
    assert repr(sp).startswith("SamplingParams(n=3, temperature=1.0")


def test_top_k_minus_one_is_off_as_in_vllm():
    assert batchrun.SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("kw, needle", [
    ({"best_of": 3}, "SamplingParams.best_of=3: not supported"),
    ({"min_p": 0.1}, "SamplingParams.min_p=0.1: not supported"),
    ({"prompt_logprobs": 1}, "SamplingParams.prompt_logprobs=1: not supported"),
    ({"skip_special_tokens": False}, "SamplingParams.skip_special_tokens=False: not supported"),
    ({"detokenize": False}, "SamplingParams.detokenize=False: not supported"),
    ({"logit_bias": {5: 1.0}}, "SamplingParams.logit_bias="),
    ({"guided_decoding": object()}, "use response_format="),
    ({"logits_processors": [lambda ids, x: x]}, "batchrun runs no Python code per step"),
    ({"top_p": 0}, "SamplingParams.top_p: must be in (0, 1]"),
    ({"temperature": "hot"}, "SamplingParams.temperature: expected a number"),
    ({"n": 0}, "SamplingParams.n: must be >= 1"),
    ({"stop": [""]}, "SamplingParams.stop: expected a string or a list of non-empty strings"),
    ({"min_tokens": 9, "max_tokens": 4}, "SamplingParams.min_tokens: must be <= max_tokens"),
    ({"response_format": {"type": "xml"}}, "SamplingParams.response_format: type must be one of"),
])
def test_bad_or_unsupported_fields_are_refused(kw, needle):
    with pytest.raises(ConfigError) as e:
        batchrun.SamplingParams(**kw)
    assert needle in str(e.value)


def test_vllm_defaults_of_unsupported_fields_are_accepted():
    sp = batchrun.SamplingParams(best_of=None, min_p=0.0, skip_special_tokens=True, detokenize=True,
                                 logits_processors=[], n=2)
    assert sp.to_job_sampling() == {"n": 2}
    assert batchrun.SamplingParams(n=2, best_of=2).to_job_sampling() == {"n": 2}
    with pytest.raises(TypeError):
        batchrun.SamplingParams(temprature=1.0)  # a typo is Python's own error


def test_one_sampling_params_per_prompt(demo_llm):
    a = batchrun.SamplingParams(max_tokens=3)
    b = batchrun.SamplingParams(max_tokens=16, stop="wor")
    c = {"max_tokens": 16, "n": 2, "temperature": 1.0}
    out = demo_llm.generate(["hello world", "hello world", "fox"], [a, b, c], use_tqdm=False)
    assert out[0].outputs[0].token_ids == demo_llm.generate("hello world", a, use_tqdm=False)[0].outputs[0].token_ids
    assert (out[0].outputs[0].finish_reason, len(out[0].outputs[0].token_ids)) == ("length", 3)
    assert (out[1].outputs[0].text, out[1].outputs[0].stop_reason) == ("hello ", "wor")
    assert len(out[2].outputs) == 2 and len(out[0].outputs) == 1
    with pytest.raises(ConfigError, match=r"sampling_params: a list of 2 for 3 prompt\(s\)"):
        demo_llm.generate(["a", "b", "c"], [a, b], use_tqdm=False)
    with pytest.raises(ConfigError, match=r"sampling_params\[1\]: sampling.top_p: must be in"):
        demo_llm.generate(["a", "b"], [a, {"top_p": 0}], use_tqdm=False)
    with pytest.raises(ConfigError, match=r"sampling_params\[0\]: expected a batchrun.SamplingParams"):
        demo_llm.generate(["a"], [0.5], use_tqdm=False)
