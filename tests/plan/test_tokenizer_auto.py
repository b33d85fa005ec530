"""The tokenizer is the one AutoTokenizer.from_pretrained returns with the installed transformers:
load_tokenizer (the engine's and the pre-run checks' loader) gives the same class, ids, decodes,
special and added tokens for tokenizer_config.json classes x config.json model_types, including
the pairs where AutoTokenizer swaps a generic class for the model's own (transformers 5.17:
TokenizersBackend on a qwen2 checkpoint -> Qwen2Tokenizer, which encodes differently); and
`plan`'s counts without transformers equal the engine's for each. CI's latest-releases lane runs
this file with the newest transformers, whose tables move."""
import json
import os

import pytest

from batchrun.common import tokenizer
from batchrun.common.tokenizer import load_tokenizer
from batchrun.errors import ConfigError
from batchrun.job.inputs.token_count import load_counter
from tests.helpers.tokenizer import char_tokenizer

CLASSES = ["TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizer", "LlamaTokenizerFast",
           "Qwen2Tokenizer", "GemmaTokenizer"]
MODEL_TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
TEXTS = ["hello world", " leading space", "  two  leading", "trailing  ", "<s>special</s> in text<sep>",
         "a<sep>b", "Ünïcödé ✓ 😀 text", "tab\there\nnew line", "?!.,;:'-", "MiXeD CaSe 123", "x"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(class, model_type): model dir}: the char tokenizer (built with `tokenizers`) saved once,
    its tokenizer_config.json's class and config.json's model_type set per pair."""
    root = tmp_path_factory.mktemp("tok")
    base = root / "base"
    char_tokenizer().save_pretrained(str(base))
    out = {}
    for cls in CLASSES:
        for model_type in MODEL_TYPES:
            d = root / f"{cls}-{model_type}"
            d.mkdir()
            for name in os.listdir(base):
                (d / name).write_bytes((base / name).read_bytes())
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            cfg["tokenizer_class"] = cls
            (d / "tokenizer_config.json").write_text(json.dumps(cfg))
            (d / "config.json").write_text(json.dumps({"model_type": model_type,
                                                       "architectures": ["LlamaForCausalLM"]}))
            out[cls, model_type] = str(d)
    return out


def _same(a, b):
    assert type(a) is type(b), (type(a).__name__, type(b).__name__)
    for special in (True, False):
        assert a(TEXTS, add_special_tokens=special)["input_ids"] == b(TEXTS, add_special_tokens=special)["input_ids"]
    assert [a.encode(t) for t in TEXTS] == [b.encode(t) for t in TEXTS]
    for ids in a(TEXTS)["input_ids"]:
        for skip in (True, False):
            assert a.decode(ids, skip_special_tokens=skip) == b.decode(ids, skip_special_tokens=skip)
    assert (a.eos_token_id, a.bos_token_id, a.pad_token_id, a.unk_token_id) == \
           (b.eos_token_id, b.bos_token_id, b.pad_token_id, b.unk_token_id)
    assert (a.all_special_tokens, a.all_special_ids) == (b.all_special_tokens, b.all_special_ids)
    assert a.get_added_vocab() == b.get_added_vocab()
    assert a.chat_template == b.chat_template


@pytest.mark.parametrize("cls", CLASSES)
def test_load_tokenizer_is_auto_tokenizer(saved, cls, monkeypatch):
    from transformers import AutoTokenizer
    for model_type in MODEL_TYPES:
        model = saved[cls, model_type]
        monkeypatch.setattr(tokenizer, "_loaded", {})
        try:
            want = AutoTokenizer.from_pretrained(model)
        except Exception:  # a class this transformers does not have: batchrun refuses it too
            with pytest.raises(ConfigError, match="model: cannot load the tokenizer"):
                load_tokenizer(model)
            continue
        _same(load_tokenizer(model), want)


@pytest.mark.parametrize("cls", ["TokenizersBackend", "PreTrainedTokenizerFast"])
def test_plan_counts_equal_the_engines(saved, cls, monkeypatch):
    """plan counts plain text with tokenizer.json alone only where AutoTokenizer keeps it as it is
    (token_count.TEXT_SAFE_MODEL_TYPES); elsewhere with transformers' tokenizer."""
    for model_type in MODEL_TYPES:
        model = saved[cls, model_type]
        monkeypatch.setattr(tokenizer, "_loaded", {})
        import pyarrow as pa
        counts = load_counter(model, messages=False).lengths(pa.array(TEXTS)).tolist()
        engine = [len(ids) for ids in load_tokenizer(model)(TEXTS)["input_ids"]]
        assert counts == engine, model_type
