"""Stop strings: find a match as tokens arrive, and cut the final text at the first match.

Each step decodes only the tail of the output (the last ``longest stop string + 8`` tokens: a
token is at least one character, plus slack for byte-level pieces), so a match spanning several
tokens is found on the step whose token completes it, at O(stop length) cost per step. The
final text is decoded in full and cut before the earliest match (or after it, with
include_stop_str_in_output), as vLLM does; the token ids are kept as generated.
"""
from __future__ import annotations

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
