"""How a row ends: the stop checks after each sampled token (stop_reason), stop strings found as
tokens arrive and cut from the final text, and the row's Result (finished_result).

Each step decodes only the tail of the output (the last ``longest stop string + 8`` tokens: a
token is at least one character, plus slack for byte-level pieces), so a match spanning several
tokens is found on the step whose token completes it, at O(stop length) cost per step. The
final text is decoded in full and cut before the earliest match (or after it, with
include_stop_str_in_output), as vLLM does; the token ids are kept as generated.
"""
from __future__ import annotations

from batchrun.engine.request import Result

_SLACK = 8


def stop_string_in_tail(tokenizer, output_ids: list[int], stops: tuple[str, ...]) -> str | None:
    """The stop string that occurs in the decoded tail of the output, or None."""
    window = max(len(s) for s in stops) + _SLACK
    tail = tokenizer.decode(output_ids[-window:], skip_special_tokens=True)
    best = None
    for s in stops:
        pos = tail.find(s)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best[1] if best else None


def truncate_at_stop(text: str, stops: tuple[str, ...], include: bool, found: str) -> tuple[str, str]:
    """(text cut at the earliest stop-string match, the string matched there)."""
    best = None
    for s in stops:
        pos = text.find(s)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    if best is None:  # the tail decode saw it, the full decode does not (tokenizer quirk): keep all
        return text, found
    pos, s = best
    return (text[:pos + len(s)] if include else text[:pos]), s


def reaches_length(seq, num_tokens: int, max_model_len: int) -> bool:
    """A row of `num_tokens` tokens (prompt + outputs) has its max_tokens outputs or fills
    max_model_len: the "length" ending. The stop checks ask it of the tokens known on the host;
    the scheduler (async steps) of those plus the one still on the device."""
    return num_tokens - seq.prompt_len >= seq.sampling.max_tokens or num_tokens >= max_model_len


def stop_reason(seq, tok: int, eos_ids, tokenizer, max_model_len: int) -> str | None:
    """"stop" or "length" when seq (whose last token is tok) is done, else None; a stop token
    id or stop string that ended it goes to seq.stop_reason."""
    sp = seq.sampling
    if seq.grammar is not None and seq.grammar.is_terminated():
        return "stop"
    num_tokens = len(seq.token_ids)
    num_output = num_tokens - seq.prompt_len
    if num_output >= sp.min_tokens:  # vLLM: nothing stops a row short of min_tokens
        if sp.stop_token_ids and tok in sp.stop_token_ids:
            seq.stop_reason = tok
            return "stop"
        if tok in eos_ids and not sp.ignore_eos:
            return "stop"
        if sp.stop:
            hit = stop_string_in_tail(tokenizer, seq.output_ids, sp.stop)
            if hit is not None:
                seq.stop_reason = hit
                return "stop"
    if reaches_length(seq, num_tokens, max_model_len):
        return "length"
    return None


def finished_result(seq, tokenizer) -> Result:
    """The Result of a finished row: its text decoded (and cut at a stop string) when there is a
    tokenizer, its logprobs when it asked for them."""
    out = seq.output_ids
    text = None
    sp = seq.sampling
    reason = seq.stop_reason
    if tokenizer is not None:
        text = tokenizer.decode(out, skip_special_tokens=True)
        if isinstance(reason, str):
            text, reason = truncate_at_stop(text, sp.stop, sp.include_stop_str_in_output, reason)
    lp = seq.logprobs if sp.logprobs is not None else None
    top = seq.top_logprobs if sp.logprobs is not None else None
    return Result(seq.request_id, seq.adapter, seq.prompt_len, out, text, seq.finish_reason,
                  stop_reason=reason, logprobs=lp, top_logprobs=top)
