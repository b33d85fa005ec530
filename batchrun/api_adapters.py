"""Which adapter each prompt of a call runs on: batchrun's ``adapters=`` names or vLLM's
``lora_request=`` (a ``LoRARequest``, vLLM's own included, or a name).

Adapters are loaded when the LLM is built (``LLM(model, adapters={name: path})``), as a job's
are; a lora_request naming a path that is not the configured one is refused rather than run on
another adapter. A name the LLM does not know gives error outputs ("unknown adapter"), as the
row would in a job.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from batchrun.errors import ConfigError


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest(lora_name, lora_int_id, lora_path): here the name picks one of the
    adapters given to ``LLM(adapters=...)``; lora_path, if given, must be that adapter's path."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


def adapter_names(adapters: Any, lora_request: Any, count: int, configured: dict[str, str]) -> list[str | None]:
    """One adapter name (None = base model) per prompt."""
    if adapters is not None and lora_request is not None:
        raise ConfigError("adapters and lora_request both given: use one (they name the same thing)")
    if lora_request is not None:
        label, value, convert = "lora_request", lora_request, lambda v, w: _lora_name(v, w, configured)
    else:
        label, value, convert = "adapters", adapters, _name
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ConfigError(f"{label}: {len(value)} entries for {count} prompt(s); give one for all prompts, "
                              "or exactly one per prompt (None = base model)")
        return [convert(v, f"{label}[{i}]") for i, v in enumerate(value)]
    return [convert(value, label)] * count


def _name(value: Any, where: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected an adapter name (str) or None, got {type(value).__name__}")
    return value


def _lora_name(value: Any, where: str, configured: dict[str, str]) -> str | None:
    if value is None or isinstance(value, str):
        return _name(value, where)
    name = getattr(value, "lora_name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: expected a LoRARequest (with lora_name), an adapter name or None, "
                          f"got {type(value).__name__}")
    path = getattr(value, "lora_path", None) or getattr(value, "path", None)
    if path:
        if name not in configured:
            raise ConfigError(f"{where}: adapter {name!r} ({path}) was not given to this LLM; adapters are "
                              f"loaded at start: batchrun.LLM(model, adapters={{{name!r}: {str(path)!r}}})")
        if os.path.realpath(os.path.expanduser(str(path))) != os.path.realpath(configured[name]):
            raise ConfigError(f"{where}: adapter {name!r} has path {path}, but this LLM loaded {name!r} from "
                              f"{configured[name]}; use the configured name, or build the LLM with this path")
    return name
