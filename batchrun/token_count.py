"""Prompt token counts for the pre-run checks and `plan`, without importing transformers when the
model directory has a ``tokenizer.json`` and prompts are plain text.

The Rust ``tokenizers`` library reads the same ``tokenizer.json`` that transformers' fast
tokenizer wraps (normaliser, pre-tokeniser, model and post-processor, so BOS/EOS templates are
applied the same way) and encodes a batch in parallel. Chat messages need the chat template,
which only transformers renders the way the engine does, so ``messages_column`` jobs (and model
directories without ``tokenizer.json``) load transformers' AutoTokenizer. The engine always
tokenizes with transformers; these counts are for checks and the plan's report.
"""
from __future__ import annotations

import os

from batchrun.errors import ConfigError


class TextCounter:
    """tokenizers.Tokenizer from tokenizer.json."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exceptions for a bad file
            raise ConfigError(f"model: cannot load the tokenizer from {path}: {e}") from None
        # transformers ignores the file's padding/truncation settings when it encodes one prompt
        self.tok.no_padding()
        self.tok.no_truncation()

    def lengths(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self.tok.encode_batch(texts)] if texts else []


class HFCounter:
    """transformers' AutoTokenizer (chat templates, or no tokenizer.json)."""

    def __init__(self, tok):
        self.tok = tok

    def lengths(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tok(texts)["input_ids"]] if texts else []

    def chat_length(self, messages, **template_kwargs) -> int:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs)
        return len(out["input_ids"] if hasattr(out, "keys") else out)


def load_counter(model_dir: str, messages: bool, load_hf) -> TextCounter | HFCounter:
    """``load_hf()``: the transformers tokenizer, loaded only if this job needs it."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not messages and os.path.isfile(path):
        return TextCounter(path)
    return HFCounter(load_hf())
