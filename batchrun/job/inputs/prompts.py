"""A row's prompt -> token ids, the one way the runner and `plan` both use.

- ``prompt_column`` text: the tokenizer's own special tokens (``add_special_tokens: auto`` or true),
  or none (false). With ``system_prompt`` set, the text is rendered as ``[system, user=prompt]``
  through the chat template instead.
- ``messages_column``: the chat template (with ``chat_template_kwargs``), a ``system_prompt``
  prepended when the row's messages do not start with one. ``auto`` adds no special tokens
  (the template wrote them: no double BOS); true tokenizes the rendered text with them.
- ``prompt_token_ids_column``: the ids as given (no tokenizer).
"""
from __future__ import annotations

from batchrun.job.jobfile.spec import InputSpec


def uses_chat_template(inp: InputSpec) -> bool:
    return bool(inp.messages_column) or (bool(inp.prompt_column) and inp.system_prompt is not None)


def chat_messages(inp: InputSpec, prompt: str | None = None, messages: list | None = None) -> list[dict]:
    msgs = [{"role": "user", "content": prompt}] if messages is None else list(messages)
    if inp.system_prompt is not None and not (msgs and msgs[0].get("role") == "system"):
        msgs = [{"role": "system", "content": inp.system_prompt}] + msgs
    return msgs


def _ids(encoded) -> list[int]:
    # apply_chat_template(tokenize=True) returns a list in some transformers versions and a
    # BatchEncoding/dict in others.
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def chat_token_ids(tokenizer, inp: InputSpec, messages: list[dict]) -> list[int]:
    kwargs = dict(inp.chat_template_kwargs or {})
    if inp.add_special_tokens is True:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    return _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs))


def text_token_ids(tokenizer, inp: InputSpec, texts: list[str]) -> list[list[int]]:
    if inp.add_special_tokens == "auto":
        return [list(x) for x in tokenizer(texts)["input_ids"]]
    return [list(x) for x in tokenizer(texts, add_special_tokens=inp.add_special_tokens)["input_ids"]]
