"""engine.max_model_len: auto (the default): the model's context (config.json
max_position_embeddings), lowered when the engine starts to what the KV cache holds for one
sequence, with one warning line; an explicit value longer than the context stays an error, and
the requests are checked against the resolved value."""
import logging

import pytest

from batchrun.api import LLM
from batchrun.engine.config import EngineConfig, SamplingParams, context_max_model_len
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from batchrun.errors import ConfigError
from tests.helpers.models import model_config, save_hf_model
from tests.helpers.tokenizer import build_tokenizer

# char_llama: 1 layer, 2 KV heads of 16 -> 2 * 2 * 16 * 4 bytes = 256 bytes of fp32 KV a token,
# 4 KiB a block of 16
BLOCK_BYTES = 256 * 16


@pytest.fixture(scope="module")
def model_512(tmp_path_factory):
    path = tmp_path_factory.mktemp("ctx512") / "model"
    save_hf_model("char_llama", path, tokenizer=build_tokenizer(), over={"max_position_embeddings": 512})
    return str(path)


@pytest.fixture(scope="module")
def model_128k(tmp_path_factory):
    path = tmp_path_factory.mktemp("ctx128k") / "model"
    save_hf_model("char_llama", path, tokenizer=build_tokenizer(), over={"max_position_embeddings": 131072})
    return str(path)


def test_a_512_context_model_runs_without_setting_it(model_512):
    llm = LLM(model_512, device="cpu")
    assert llm.spec.engine.max_model_len == "auto"
    assert llm.engine.config.max_model_len == 512
    ok, long = llm.generate(["hello world", "x" * 600], {"max_tokens": 4}, use_tqdm=False)
    assert ok.error is None and len(ok.outputs[0].token_ids) == 4
    # the request check uses the resolved value, named as job.yaml names it
    assert long.error == "prompt has 602 tokens; with max_tokens 4 that exceeds engine.max_model_len 512"


def test_max_tokens_is_checked_against_the_resolved_value(model_512):
    llm = LLM(model_512, device="cpu")
    with pytest.raises(ConfigError, match=r"sampling.max_tokens: must be smaller than engine.max_model_len "
                                          r"\(512, auto: the model's context\)"):
        llm.generate(["hi"], {"max_tokens": 512}, use_tqdm=False)


def test_an_explicit_value_longer_than_the_context_is_an_error(model_512):
    msg = (r"engine.max_model_len: 1024 is longer than the model's context \(max_position_embeddings "
           r"512 in .*config.json\); set engine.max_model_len <= 512")
    with pytest.raises(ConfigError, match=msg):
        Engine.from_config(EngineConfig(model=model_512, device="cpu", max_model_len=1024))
    with pytest.raises(ConfigError, match=msg):
        LLM(model_512, device="cpu", max_model_len=1024)  # the pre-weights check of `batchrun run`
    assert LLM(model_512, device="cpu", max_model_len=256).engine.config.max_model_len == 256


def test_a_128k_context_is_lowered_to_the_cpu_kv_cache_with_one_log_line(model_128k, caplog):
    gb = 1310 * BLOCK_BYTES / (1 << 30)  # 1310 blocks: 1309 besides the scratch block
    with caplog.at_level(logging.WARNING, logger="batchrun.engine"):
        engine = Engine.from_config(EngineConfig(model=model_128k, device="cpu", cpu_kv_cache_gb=gb,
                                                 max_num_seqs="auto"))
    fit = 1309 * 16
    assert engine.config.max_model_len == engine.max_model_len == fit
    assert engine.config.max_num_seqs == 1  # auto counts sequences of the lowered length
    lines = [r.getMessage() for r in caplog.records if r.name == "batchrun.engine"]
    assert len(lines) == 1
    assert (f"engine.max_model_len auto is {fit}, not the model's context 131072: the KV cache "
            f"(engine.cpu_kv_cache_gb) holds {fit} tokens") in lines[0]
    assert "set engine.max_model_len lower" in lines[0]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    ok, long = engine.generate([Request("ok", [5, 6, 7], sp), Request("long", [5] * fit, sp)])
    assert ok.finish_reason == "length" and len(ok.output_token_ids) == 4
    assert long.finish_reason == "error"
    assert long.error == f"prompt has {fit} tokens; with max_tokens 4 that exceeds max_model_len ({fit})"


def test_a_cache_without_one_block_is_an_error(model_128k):
    with pytest.raises(ConfigError, match=r"the KV cache holds no block of 16 tokens .* "
                                          r"the model's context is 131072\); give the cache more memory "
                                          r"\(engine.cpu_kv_cache_gb\)"):
        Engine.from_config(EngineConfig(model=model_128k, device="cpu", cpu_kv_cache_gb=BLOCK_BYTES / (1 << 30)))


def test_an_explicit_value_is_not_lowered(model_128k):
    gb = 1310 * BLOCK_BYTES / (1 << 30)
    with pytest.raises(ConfigError, match="one sequence of max_model_len=65536 needs"):
        Engine.from_config(EngineConfig(model=model_128k, device="cpu", cpu_kv_cache_gb=gb, max_model_len=65536))


def test_auto_is_the_context_whatever_the_sliding_window():
    """Sliding-window layers attend within their window at any length: auto is the context."""
    assert context_max_model_len("auto", model_config("mistral", sliding_window=256)) == 512
    assert context_max_model_len("auto", model_config("mistral", sliding_window=None)) == 512
    assert context_max_model_len(300, model_config("mistral", sliding_window=256)) == 300
