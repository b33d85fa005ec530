"""Prompt token counts for the pre-run checks and `plan`, with the tokenizer the engine uses
(batchrun/common/tokenizer.py loads it, once per process). Counting never keeps a Python
object per row: a column chunk's distinct strings are encoded in one batch by the Rust
``tokenizers`` library and only their lengths come back, as a numpy array.

``plan`` on plain-text prompts does not import transformers (nor torch) when the directory's
tokenizer is a plain ``tokenizer.json`` that transformers wraps unchanged (``TEXT_SAFE_CLASSES``,
none of the options in ``_REWRITING_OPTIONS``, a config.json model_type in
``TEXT_SAFE_MODEL_TYPES``): those tokenizers encode through the same Rust object, so the counts
are the engine's. Any other tokenizer is loaded through transformers and
counted with its own backend tokenizer. Chat messages are rendered with the tokenizer's chat
template (``apply_chat_template(tokenize=False)``, one string per row) and the rendered strings
encoded in one batch without special tokens, which is what ``apply_chat_template(tokenize=True)``
does for the engine.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa

from batchrun.common.tokenizer import _cached, _tokenizer_config, load_tokenizer
from batchrun.errors import ConfigError

# transformers' generic fast-tokenizer classes: they use tokenizer.json's pipeline as it is.
TEXT_SAFE_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}
# config.json model_types for which AutoTokenizer keeps a generic tokenizer_class as it is. For
# others it may build the model's own tokenizer class, which encodes differently (transformers
# 5.17 turns a qwen2 checkpoint's TokenizersBackend into Qwen2Tokenizer, and the list of such
# types grows between releases), so they are counted with transformers' tokenizer.
# tests/plan/test_tokenizer_auto.py checks these against AutoTokenizer, in the latest-releases
# CI lane too.
TEXT_SAFE_MODEL_TYPES = {"llama", "mistral"}
# tokenizer_config.json options with which transformers rebuilds parts of that pipeline
_REWRITING_OPTIONS = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow",
                      "split_special_tokens", "do_lower_case")
def _counting_copy(tok):
    """A tokenizers.Tokenizer that encodes as transformers' ``tokenizer(text)`` does: no padding,
    no truncation (transformers ignores the file's settings for one unpadded prompt)."""
    from tokenizers import Tokenizer
    copy = Tokenizer.from_str(tok.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy


def _encode_lengths(tok, texts: list[str], add_special_tokens: bool) -> np.ndarray:
    if not texts:
        return np.zeros(0, dtype=np.int64)
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch  # _fast: no offsets (0.21+)
    # len(encoding), not len(encoding.ids): no Python list of ids per row
    return np.fromiter((len(e) for e in encode(texts, add_special_tokens=add_special_tokens)),
                       dtype=np.int64, count=len(texts))


class Counter:
    """Token counts of prompt strings and of chat conversations, as the engine tokenizes them."""

    def __init__(self, backend, hf=None):
        # backend None: a slow (Python) transformers tokenizer, which encodes row by row
        self.backend = _counting_copy(backend) if backend is not None else None
        self.hf = hf  # transformers tokenizer: chat templates (and slow tokenizers)

    def _lengths(self, texts: list[str], add_special_tokens: bool) -> np.ndarray:
        if self.backend is not None:
            return _encode_lengths(self.backend, texts, add_special_tokens)
        ids = self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"] if texts else []
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(texts))

    def lengths(self, texts: pa.Array | pa.ChunkedArray, add_special_tokens: bool = True) -> np.ndarray:
        """Tokens of each string (0 for nulls), special tokens included unless
        ``add_special_tokens`` is False. Each distinct string is encoded once."""
        if isinstance(texts, pa.ChunkedArray):
            texts = texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
        if pa.types.is_null(texts.type):
            return np.zeros(len(texts), dtype=np.int64)
        if pa.types.is_string_view(texts.type) or (
                pa.types.is_dictionary(texts.type) and pa.types.is_string_view(texts.type.value_type)):
            texts = texts.cast(pa.large_string())
        enc = texts if pa.types.is_dictionary(texts.type) else texts.dictionary_encode()
        unique = self._lengths(enc.dictionary.to_pylist(), add_special_tokens)
        idx = enc.indices.fill_null(0).to_numpy(zero_copy_only=False)
        out = unique[idx] if len(unique) else np.zeros(len(texts), dtype=np.int64)
        if enc.null_count:
            out[np.asarray(enc.indices.is_null())] = 0
        return out

    def chat_lengths(self, conversations: list, template_kwargs: dict | None = None,
                     add_special_tokens: bool = False) -> np.ndarray:
        """Tokens of each conversation with the generation prompt (``template_kwargs`` passed to
        the template; the rendered text tokenized with or without special tokens, as
        prompts.chat_token_ids does); -1 where the template fails (the engine refuses that row)
        or the conversation is None."""
        if self.hf is None:
            raise RuntimeError("chat_lengths needs the transformers tokenizer (load_counter(messages=True))")
        rendered, where = [], []
        out = np.full(len(conversations), -1, dtype=np.int64)
        for i, msgs in enumerate(conversations):
            if msgs is None:
                continue
            try:
                text = self.hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                                   **(template_kwargs or {}))
            except Exception:  # a template can raise anything (jinja errors, role checks)
                continue
            rendered.append(text)
            where.append(i)
        out[where] = self._lengths(rendered, add_special_tokens)
        return out


def _text_safe(model_dir: str) -> str | None:
    """tokenizer.json's path when transformers would use it unchanged, else None."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    cfg = _tokenizer_config(model_dir)
    if cfg is None or cfg.get("tokenizer_class") not in TEXT_SAFE_CLASSES:
        return None
    if any(k in cfg for k in _REWRITING_OPTIONS):
        return None
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return path if model_type in TEXT_SAFE_MODEL_TYPES else None


def load_counter(model_dir: str, messages: bool, use_transformers: bool = False) -> Counter:
    """The counter for a job. ``use_transformers``: count with the transformers tokenizer (a run
    loads it anyway for the engine, so it is loaded once); ``plan`` leaves it False so plain-text
    prompts on a plain tokenizer.json need neither transformers nor torch. ConfigError when the
    tokenizer cannot be loaded."""
    model_dir = str(model_dir)
    path = None if (messages or use_transformers) else _text_safe(model_dir)
    if path is not None:
        def load():
            from tokenizers import Tokenizer
            try:
                return Tokenizer.from_file(path)
            except Exception as e:  # the Rust side raises plain Exceptions for a bad file
                raise ConfigError(f"model: cannot load the tokenizer from {path}: {e}") from None
        return _cached("counter", model_dir, lambda: Counter(load()))
    hf = load_tokenizer(model_dir)
    if hf is None:
        raise ConfigError(f"model: {model_dir} has no tokenizer (tokenizer.json, tokenizer.model or "
                          "vocab.json); batchrun needs one to turn prompts into tokens")
    return _cached("counter-hf", model_dir, lambda: Counter(getattr(hf, "backend_tokenizer", None), hf))
