"""request_check.py: the one decision whether a request can run (#10), used by rows.build_unit
(through Engine.check_request), the engine for requests it has not seen checked, and plan."""
import numpy as np
import pytest

from batchrun.engine.config import SamplingParams
from batchrun.engine.request_check import RequestLimits, request_problem, too_long

LIMITS = RequestLimits(16, vocab_size=100, adapters={"a"}, format_problem=lambda f: "does not compile")


def test_messages():
    sp = SamplingParams(max_tokens=8)
    assert request_problem([1, 2], sp, None, LIMITS) is None
    assert request_problem([], sp, None, LIMITS) == "empty prompt (no tokens)"
    assert request_problem([1, 100], sp, None, LIMITS) == "prompt has token ids outside the vocabulary [0, 100)"
    ten = list(range(10))
    assert request_problem(ten, sp, None, LIMITS) == \
        "prompt has 10 tokens; with max_tokens 8 that exceeds max_model_len (16)"
    assert request_problem(ten, sp, None, LIMITS, job=True) == \
        "prompt has 10 tokens; with max_tokens 8 that exceeds engine.max_model_len 16"
    assert request_problem([1], sp, "b", LIMITS) == "unknown adapter 'b' (known: a)"
    assert "LoRA is not enabled" in request_problem([1], sp, "a", RequestLimits(16))
    assert request_problem([1], SamplingParams(max_tokens=2, response_format="{}"), None, LIMITS) == "does not compile"
    assert "needs a tokenizer" in request_problem([1], SamplingParams(max_tokens=2, stop=("x",)), None,
                                                  RequestLimits(16, has_tokenizer=False))


def test_too_long_is_the_same_rule_on_columns():
    lens = np.array([8, 9, 0])
    assert too_long(lens, np.array([8, 8, 8]), 16).tolist() == [False, True, False]
    assert too_long(9, 8, 16) and not too_long(8, 8, 16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.helpers.models import save_hf_model
    d = tmp_path_factory.mktemp("m") / "llama3_gqa"
    save_hf_model("llama3_gqa", d, seed=3)
    return str(d)


def test_engine_checks_only_unchecked_requests(model_dir):
    from batchrun.engine.config import EngineConfig
    from batchrun.engine.engine import Engine
    from batchrun.engine.request import Request
    engine = Engine.from_config(EngineConfig(model=model_dir, device="cpu", max_model_len=64))
    calls = []
    real = engine.check_request
    engine.check_request = lambda req, job=False: calls.append(req.request_id) or real(req, job)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    out = engine.generate([Request("api", [5, 6], sp), Request("rows", [5, 6], sp, checked=True),
                           Request("bad", [], sp)])
    assert calls == ["api", "bad"]  # build_unit's requests were checked there, once
    assert [r.finish_reason for r in out] == ["length", "length", "error"]
