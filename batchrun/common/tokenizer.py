"""The model directory's transformers tokenizer, loaded once per process.

``load_tokenizer`` is the one loader: the engine and the job side's pre-run checks
(job/inputs/token_count.py) both call it, and it returns the same tokenizer for the same directory
(until its files change). It waits for `batchrun run`'s background imports first
(common/preload.py): two threads importing transformers at once can see it half initialised.
"""
from __future__ import annotations

import json
import os
import threading

from batchrun.common import preload
from batchrun.errors import ConfigError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

_lock = threading.Lock()
_loaded: dict = {}  # (kind, abs dir, file stamps) -> tokenizer


def _stamp(model_dir: str) -> tuple:
    out = []
    for name in _TOKENIZER_FILES + ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        try:
            st = os.stat(os.path.join(model_dir, name))
            out.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            pass
    return tuple(out)


def _cached(kind: str, model_dir: str, load):
    key = (kind, os.path.abspath(model_dir), _stamp(model_dir))
    with _lock:
        if key not in _loaded:
            _loaded[key] = load()
        return _loaded[key]


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.exists(os.path.join(model_dir, n)) for n in _TOKENIZER_FILES)


def load_tokenizer(model_dir: str):
    """The directory's transformers tokenizer (loaded once per process), or None when the
    directory has no tokenizer files (random-weight benchmarks). ConfigError if it is broken."""
    model_dir = str(model_dir)
    if not has_tokenizer(model_dir):
        return None
    preload.wait()  # transformers may be importing on the preload thread (or loading this tokenizer)

    def load():
        # AutoTokenizer itself, never a class picked here from tokenizer_config.json: which class
        # it returns depends on config.json's model_type and on tables that change between
        # transformers releases (5.x maps a qwen2 checkpoint whose tokenizer_config.json says
        # TokenizersBackend or PreTrainedTokenizerFast to Qwen2Tokenizer, which encodes
        # differently), so the engine tokenizes as transformers does with the installed version.
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        except Exception as e:  # transformers raises many types for a broken/missing tokenizer
            raise ConfigError(f"model: cannot load the tokenizer from {model_dir}: {e}") from None

    return _cached("hf", model_dir, load)


def _tokenizer_config(model_dir: str) -> dict | None:
    """tokenizer_config.json as a dict: {} when the file is absent, None when it is unreadable or
    not an object (transformers reports, or copes with, a damaged config)."""
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None
