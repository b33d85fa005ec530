"""Structured output (sampling.response_format) through xgrammar, an optional extra.

Why xgrammar: it is the grammar engine vLLM and SGLang ship by default, compiles JSON schema,
free JSON and regex to one token-mask matcher, and masks a batch with one bitmask kernel (CPU
and CUDA). It is optional (``pip install 'batchrun[structured]'``): a job that asks for
response_format without it gets a configuration error saying so; other jobs never import it.

Only rows with a format pay: their logits get the matcher's token mask before sampling (other
rows, and the CUDA-graph decode path, are untouched), and each sampled token advances the row's
matcher. Compiled grammars are cached per canonical format JSON.
"""
from __future__ import annotations

import json

import torch

from batchrun.errors import ConfigError

INSTALL_HINT = ("sampling.response_format needs the optional package xgrammar, which is not installed; "
                "install it (pip install 'batchrun[structured]' or pip install xgrammar) or remove response_format")


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return xgrammar


class Grammars:
    """Compiles formats for one tokenizer and keeps each sequence's matcher."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.xgr = _xgrammar()
        info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(eos_ids) or None)
        self.compiler = self.xgr.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._compiled: dict[str, object] = {}
        self._errors: dict[str, str] = {}

    def compile(self, fmt: str):
        """The compiled grammar; ValueError naming the problem when it does not compile."""
        if fmt in self._errors:
            raise ValueError(self._errors[fmt])
        if fmt not in self._compiled:
            spec = json.loads(fmt)
            try:
                if spec["type"] == "json_schema":
                    g = self.compiler.compile_json_schema(json.dumps(spec["schema"]), any_whitespace=False)
                elif spec["type"] == "json_object":
                    g = self.compiler.compile_builtin_json_grammar()
                else:
                    g = self.compiler.compile_regex(spec["pattern"])
            except Exception as e:  # xgrammar raises RuntimeError with the C++ location first
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                msg = msg.split("] ", 1)[-1] if msg.startswith("[") else msg
                self._errors[fmt] = f"response_format ({spec['type']}) does not compile: {msg}"
                raise ValueError(self._errors[fmt]) from None
            self._compiled[fmt] = g
        return self._compiled[fmt]

    def matcher(self, fmt: str):
        return self.xgr.GrammarMatcher(self.compile(fmt))

    def mask(self, logits: torch.Tensor, rows: list[int], matchers: list) -> torch.Tensor:
        """Logits with the constrained rows' disallowed tokens at -inf (out of place)."""
        bitmask = self.xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, j)
        idx = torch.tensor(rows, device=logits.device)
        sub = logits[idx].float().contiguous()
        self.xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device))
        out = logits.clone()
        out[idx] = sub.to(logits.dtype)
        return out


def check_response_format(fmt: str, tokenizer, vocab_size: int, eos_ids) -> None:
    """Job-level check before weights load: ConfigError unless the format compiles."""
    if tokenizer is None:
        raise ConfigError("sampling.response_format: needs a tokenizer, and the model directory has none")
    try:
        Grammars(tokenizer, vocab_size, eos_ids).compile(fmt)
    except ValueError as e:
        raise ConfigError(f"sampling.{e}") from None
