"""Whether a request can run: the one check that decides it.

`rows.build_unit` (the runner's and batchrun.LLM's rows, through `Engine.check_request`), the
engine itself (every request `Engine.generate` / `generate_stream` takes, so a bad request from
the Python API is an error result, never a crash in a kernel) and `batchrun plan`'s error-row
count (`too_long`, on whole columns of token counts) all use it. No torch here: `plan` runs
without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection

from batchrun.engine.config import SamplingParams
from batchrun.common.short_repr import short_repr


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can run."""
    max_model_len: int
    vocab_size: int | None = None  # None: not known (no weights loaded)
    has_tokenizer: bool = True  # stop strings and response_format need one
    adapters: Collection[str] | None = None  # the adapters loaded; None: LoRA is disabled
    # response_format (canonical JSON) -> why it does not compile, or None
    format_problem: Callable[[str], str | None] | None = None


def too_long(prompt_tokens, max_tokens, max_model_len):
    """Prompt + output over the context; elementwise on numpy arrays (plan counts columns)."""
    return prompt_tokens + max_tokens > max_model_len


def request_problem(token_ids, sampling: SamplingParams, adapter: str | None, limits: RequestLimits,
                    job: bool = False) -> str | None:
    """Why this request cannot run, or None. ``job``: name the limit as job.yaml does
    (``engine.max_model_len 128``) rather than as EngineConfig does (``max_model_len (128)``)."""
    n = len(token_ids)
    if not n:
        return "empty prompt (no tokens)"
    vocab = limits.vocab_size
    if vocab is not None and (min(token_ids) < 0 or max(token_ids) >= vocab):
        return f"prompt has token ids outside the vocabulary [0, {vocab})"
    if too_long(n, sampling.max_tokens, limits.max_model_len):
        limit = (f"engine.max_model_len {limits.max_model_len}" if job
                 else f"max_model_len ({limits.max_model_len})")
        return f"prompt has {n} tokens; with max_tokens {sampling.max_tokens} that exceeds {limit}"
    if sampling.stop and not limits.has_tokenizer:
        return "sampling.stop (stop strings) needs a tokenizer, and this model directory has none"
    if sampling.response_format is not None:
        if not limits.has_tokenizer:
            return "sampling.response_format needs a tokenizer, and this model directory has none"
        if limits.format_problem is not None:
            problem = limits.format_problem(sampling.response_format)
            if problem:
                return problem
    if adapter:
        if limits.adapters is None:
            return f"adapter {short_repr(adapter)} requested but LoRA is not enabled in this engine"
        if adapter not in limits.adapters:
            known = ", ".join(sorted(limits.adapters)) or "none"
            return f"unknown adapter {short_repr(adapter)} (known: {known})"
    return None
