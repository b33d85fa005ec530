"""What ``LLM.generate`` / ``LLM.chat`` return: vLLM's RequestOutput / CompletionOutput fields,
plus batchrun's (adapter, prompt_tokens, error; top_logprobs as the output Parquet holds them)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int  # sample index (0..n-1)
    text: str | None  # None without a tokenizer, or for an error output
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of logprobs; None unless logprobs was requested
    logprobs: list[float] | None = None  # each generated token's logprob (logprobs=k set)
    finish_reason: str = "stop"  # stop | length | error
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (not EOS)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: the top k (token id, logprob)


@dataclass
class RequestOutput:
    request_id: int | str  # the prompt's id (request_ids / a prompt dict's id), else its position
    prompt: str | None  # the text given; for a conversation the chat-template rendering; None for token ids
    prompt_token_ids: list[int] | None  # what the engine ran; None when the prompt could not run
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    index: int = 0  # position in the call
    adapter: str | None = None
    prompt_tokens: int = 0
    error: str | None = None  # set when the prompt could not run (outputs are then error outputs)


def completion(res, index: int) -> CompletionOutput:
    """An engine Result -> CompletionOutput (sample ``index`` of its prompt)."""
    ok = res.finish_reason != "error"
    lps = res.logprobs if ok else None
    return CompletionOutput(index, res.output_text if ok else None, list(res.output_token_ids),
                            None if lps is None else float(sum(lps)), lps, res.finish_reason, res.stop_reason,
                            res.top_logprobs if ok else None)
