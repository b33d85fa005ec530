"""What ``LLM.generate`` / ``LLM.chat`` return: vLLM's RequestOutput / CompletionOutput / Logprob
fields, plus batchrun's (adapter, prompt_tokens, error; top_logprobs as the output Parquet holds
them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None for a sampled token outside the top k (not computed)
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int  # sample index (0..n-1)
    text: str | None  # None without a tokenizer, or for an error output
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the tokens' logprobs; None unless logprobs was requested
    # vLLM's form, logprobs=k set: per output token {token id: Logprob} for the top k and the sampled token
    logprobs: list[dict[int, Logprob]] | None = None
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


def completion(res, index: int, decode: Callable[[int], str | None]) -> CompletionOutput:
    """An engine Result -> CompletionOutput (sample ``index`` of its prompt); ``decode`` gives a
    token id's text for Logprob.decoded_token."""
    ok = res.finish_reason != "error"
    lps, tops = (res.logprobs, res.top_logprobs) if ok else (None, None)
    per_token = None
    if lps is not None:
        per_token = []
        for pos, (tok, lp) in enumerate(zip(res.output_token_ids, lps)):
            top = tops[pos] if tops is not None else []
            d = {t: Logprob(v, rank, decode(t)) for rank, (t, v) in enumerate(top, 1)}
            if tok not in d:
                d[tok] = Logprob(lp, None, decode(tok))
            per_token.append(d)
    return CompletionOutput(index, res.output_text if ok else None, list(res.output_token_ids),
                            None if lps is None else float(sum(lps)), per_token, res.finish_reason, res.stop_reason,
                            tops)
