"""Job-file text: the file must be UTF-8, and every string in it (keys and values, at any depth)
must be text batchrun can pass on: no NUL character (paths cannot hold one; names, prompts and
stop strings with one are a quoting accident, "\\0" in a double-quoted YAML string) and no lone
surrogate ("\\ud800" in YAML: not a character, so it cannot be written as UTF-8 into a manifest,
an output or a log). Each refusal names the field.
"""
from __future__ import annotations

from typing import Any

from batchrun.errors import ConfigError


def decode_job_file(data: bytes) -> str:
    """The job file's bytes as text (UTF-8; a UTF-8 byte-order mark is dropped)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        hint = (" (the file starts with a UTF-16 byte-order mark)" if data[:2] in (b"\xff\xfe", b"\xfe\xff")
                else "")
        raise ConfigError(f"not valid UTF-8 text: byte {data[e.start]:#04x} at line {line}, column {column}"
                          f"{hint}; save the job file as UTF-8") from None


def text_problem(s: str) -> str | None:
    """Why ``s`` is not valid job-file text, or None."""
    if "\0" in s:
        return f"contains a NUL character (\\0) at position {s.index(chr(0))}"
    for i, c in enumerate(s):
        if "\ud800" <= c <= "\udfff":
            return (f"contains a lone surrogate ({c.encode('unicode_escape').decode()}) at position {i}, "
                    "which is not a character and cannot be written as UTF-8")
    return None


def check_text(raw: Any, where: str = "") -> None:
    """Raise ConfigError naming the first field (``input.path``, ``sampling.stop[1]``, or the key
    itself) whose key or string value is not valid text."""
    stack = [(raw, where)]
    seen: set[int] = set()  # containers already checked: a structure shared many times (YAML
    while stack:            # aliases, a Python dict) is walked once, not once per use
        value, path = stack.pop()
        if isinstance(value, (dict, list, tuple)):
            if id(value) in seen:
                continue
            seen.add(id(value))
        if isinstance(value, str):
            why = text_problem(value)
            if why:
                raise ConfigError(f"{path or 'job file'}: {why}; write it without")
        elif isinstance(value, dict):
            children = []
            for key, item in value.items():
                why = text_problem(key) if isinstance(key, str) else None
                child = f"{path}.{key if isinstance(key, str) and not why else repr(key)}".lstrip(".")
                if why:
                    raise ConfigError(f"{child}: the key {why}; write it without")
                children.append((item, child))
            stack.extend(reversed(children))  # popped in document order
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(value)]))
