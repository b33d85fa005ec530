"""What ``LLM.generate`` / ``LLM.chat`` were given -> one CallPrompt per prompt, with its row id.

A prompt is text, a list of token ids, or a conversation (a list of {role, content} messages);
``generate`` also takes vLLM's prompt dicts ({"prompt": ...} or {"prompt_token_ids": ...}), with
an optional "id". The id is the row id a job would give the prompt: it seeds sampling exactly as
``batchrun run`` seeds that row (rows.row_seed hashes the id's repr, so ids are kept as the int or
str a Parquet id column reads as). Without ids, a prompt's id is its position in the call.
Mistakes in the call's structure raise ConfigError naming the prompt; an empty text or a
template that fails is an error output, as the row would be in a job.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Sequence

from batchrun.errors import ConfigError

KINDS = {"text": "prompt", "messages": "messages", "ids": "prompt_token_ids"}  # kind -> row column
_DICT_KEYS = ("prompt", "prompt_token_ids", "id")


@dataclass(frozen=True)
class CallPrompt:
    kind: str  # text | ids | messages
    value: Any  # str | list[int] | list[dict]
    id: int | str  # the row id (seeds sampling)


def _token_ids(p: Any) -> list[int] | None:
    """p as token ids if it is a non-empty list of integers (numpy ones included), else None."""
    if isinstance(p, (list, tuple)) and p and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                   for t in p):
        return [int(t) for t in p]
    return None


def _is_conversation(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p) and "role" in p[0]


def _conversation(p: Any, where: str) -> list[dict]:
    if not isinstance(p, (list, tuple)) or not p:
        raise ConfigError(f"{where}: a conversation must be a non-empty list of {{role, content}} messages, "
                          f"got {_type(p)}")
    for j, m in enumerate(p):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ConfigError(f"{where}: message {j} must be a dict with role and content, got {_type(m)}")
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise ConfigError(f"{where}: message {j} {key} must be a string, got {_type(m[key])}")
    return [dict(m) for m in p]


def _type(v: Any) -> str:
    return "an empty list" if isinstance(v, (list, tuple)) and not v else type(v).__name__


def row_id(value: Any, where: str) -> int | str:
    """A request id as the job's id column holds it: an int or a str (numpy scalars converted)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        return str(value)
    raise ConfigError(f"{where}: a request id must be an integer or a string (what a job's id column "
                      f"holds), got {type(value).__name__}")


def generate_prompts(prompts: Any, request_ids: Sequence | None = None) -> list[CallPrompt]:
    """``generate``'s prompts: one prompt or a list of them."""
    if isinstance(prompts, (str, dict)) or _token_ids(prompts) is not None or _is_conversation(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ConfigError(f"prompts: expected a prompt or a list of prompts, got {type(prompts).__name__}")
    out, given = [], []
    for i, p in enumerate(prompts):
        where = f"prompts[{i}]"
        pid = None
        if isinstance(p, dict):
            extra = [k for k in p if k not in _DICT_KEYS]
            if extra:
                raise ConfigError(f"{where}: key {extra[0]!r} is not supported (a prompt dict has prompt or "
                                  "prompt_token_ids, and optionally id)")
            if ("prompt" in p) == ("prompt_token_ids" in p):
                raise ConfigError(f"{where}: a prompt dict needs exactly one of prompt, prompt_token_ids")
            if "id" in p:
                pid = row_id(p["id"], f"{where}.id")
            p = p["prompt"] if "prompt" in p else p["prompt_token_ids"]
            if not isinstance(p, str) and _token_ids(p) is None:
                raise ConfigError(f"{where}: expected a string prompt or a non-empty list of token ids, "
                                  f"got {_type(p)}")
        given.append(pid)
        ids = _token_ids(p)
        if isinstance(p, str):
            out.append(("text", p))
        elif ids is not None:
            out.append(("ids", ids))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(m, dict) for m in p):
            out.append(("messages", _conversation(p, where)))
        else:
            raise ConfigError(f"{where}: each prompt must be a string, a non-empty list of token ids, a list of "
                              f"{{role, content}} messages or a prompt dict, got {_type(p)}")
    ids = _ids(given, request_ids)
    return [CallPrompt(kind, value, pid) for (kind, value), pid in zip(out, ids)]


def chat_prompts(messages: Any, request_ids: Sequence | None = None) -> list[CallPrompt]:
    """``chat``'s messages: one conversation or a list of conversations."""
    if _is_conversation(messages):
        messages = [messages]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError("messages: expected a conversation (a list of {role, content} dicts) or a non-empty "
                          f"list of conversations, got {_type(messages)}")
    convs = [_conversation(c, f"messages[{i}]") for i, c in enumerate(messages)]
    ids = _ids([None] * len(convs), request_ids)
    return [CallPrompt("messages", c, pid) for c, pid in zip(convs, ids)]


def _ids(given: list, request_ids: Sequence | None) -> list[int | str]:
    n = len(given)
    if request_ids is not None:
        if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Sequence):
            raise ConfigError(f"request_ids: expected a list with one id per prompt, got {type(request_ids).__name__}")
        if len(request_ids) != n:
            raise ConfigError(f"request_ids: {len(request_ids)} ids for {n} prompt(s); give exactly one per prompt")
        if any(g is not None for g in given):
            raise ConfigError("request_ids: the prompts carry ids already (prompt dicts with id); give ids one way")
        ids = [row_id(v, f"request_ids[{i}]") for i, v in enumerate(request_ids)]
    elif any(g is not None for g in given):
        if any(g is None for g in given):
            missing = next(i for i, g in enumerate(given) if g is None)
            raise ConfigError(f"prompts[{missing}]: has no id while other prompts have one; give every prompt an "
                              "id, or none (ids are then positions in the call)")
        ids = list(given)
    else:
        return list(range(n))
    seen: dict = {}
    for i, v in enumerate(ids):
        if v in seen:
            raise ConfigError(f"request ids: {v!r} is given to prompts {seen[v]} and {i}; each id names one row "
                              "(it seeds that row's sampling)")
        seen[v] = i
    return ids
