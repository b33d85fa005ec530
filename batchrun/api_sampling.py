"""``batchrun.SamplingParams``: vLLM's field names over job.yaml's ``sampling:`` section.

A field left unset (None) is what a job file leaves out: the model's generation_config.json
value if it sets one (temperature, top_p, top_k, repetition_penalty, max_new_tokens), else
job.yaml's default (greedy, max_tokens 64, seed 0). So ``SamplingParams(**job_sampling)`` runs a
prompt exactly as the job runs that row. This differs from vLLM, whose unset fields mean
temperature 1.0 and max_tokens 16: set them to get vLLM's values.

``seed`` is the job seed: each prompt's own seed is derived from it and the prompt's id
(``request_ids``, or its position in the call), as ``batchrun run`` derives a row's.

vLLM fields batchrun does not implement are accepted only at vLLM's default (the value that
changes nothing), so code written for vLLM fails loudly instead of being silently ignored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import _SAMPLING_SCHEMA, _fields, _int_list, _str_list, response_format_json, \
    sampling_problems

# vLLM SamplingParams fields batchrun does not implement -> (vLLM's default, what to do instead).
UNSUPPORTED = {
    "best_of": (None, "sample n outputs with n (best_of ranks extra samples; batchrun does not)"),
    "min_p": (0.0, "use top_p or top_k"),
    "prompt_logprobs": (None, "batchrun returns logprobs of generated tokens only (logprobs=k)"),
    "detokenize": (True, "token ids are always returned beside the text"),
    "skip_special_tokens": (True, "output text always skips special tokens"),
    "spaces_between_special_tokens": (True, "output text always skips special tokens"),
    "logits_processors": (None, "batchrun runs no Python code per step"),
    "truncate_prompt_tokens": (None, "truncate the prompt before the call; a too-long prompt is an error output"),
    "guided_decoding": (None, "use response_format={'type': 'json_schema'|'json_object'|'regex', ...}"),
    "structured_outputs": (None, "use response_format={'type': 'json_schema'|'json_object'|'regex', ...}"),
    "allowed_token_ids": (None, "use response_format with a regex"),
    "logit_bias": (None, "not available"),
    "bad_words": (None, "not available"),
    "output_kind": (None, "outputs are returned once, complete"),
    "extra_args": (None, "not available"),
}


@dataclass(kw_only=True, repr=False)
class SamplingParams:
    """Sampling settings for ``LLM.generate`` / ``LLM.chat`` (vLLM's names; None = unset)."""
    n: int | None = None  # outputs per prompt
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None  # 0 = off (vLLM's older -1 also means off)
    seed: int | None = None  # the job seed (see the module note)
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None  # k: each generated token's logprob and the top k
    response_format: dict | None = None  # {type: json_schema, schema: ...} | {type: json_object} | {type: regex, pattern: ...}
    best_of: Any = None
    min_p: Any = 0.0
    prompt_logprobs: Any = None
    detokenize: Any = True
    skip_special_tokens: Any = True
    spaces_between_special_tokens: Any = True
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    guided_decoding: Any = None
    structured_outputs: Any = None
    allowed_token_ids: Any = None
    logit_bias: Any = None
    bad_words: Any = None
    output_kind: Any = None
    extra_args: Any = None

    def __post_init__(self):
        if self.top_k == -1:
            self.top_k = 0
        for name, (default, instead) in UNSUPPORTED.items():
            value = getattr(self, name)
            if name == "best_of" and value is not None and value == (self.n or 1):
                continue  # best_of == n samples exactly n: nothing to rank
            if not _is_default(value, default):
                raise ConfigError(f"SamplingParams.{name}={value!r}: not supported by batchrun ({instead})")
        self.to_job_sampling()  # the job file's checks, with SamplingParams.<field> in the message

    def set_fields(self) -> dict[str, Any]:
        """The supported fields given a value (not None)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in UNSUPPORTED and getattr(self, f.name) is not None}

    def to_job_sampling(self) -> dict[str, Any]:
        """The set fields as a job.yaml ``sampling:`` mapping; raises ConfigError on a bad value."""
        raw = self.set_fields()
        if "stop" in raw:
            stop = list(raw["stop"]) if isinstance(raw["stop"], tuple) else raw["stop"]
            raw["stop"] = list(_str_list(stop, "SamplingParams.stop"))
        if "stop_token_ids" in raw:
            ids = list(raw["stop_token_ids"]) if isinstance(raw["stop_token_ids"], tuple) else raw["stop_token_ids"]
            raw["stop_token_ids"] = list(_int_list(ids, "SamplingParams.stop_token_ids"))
        checked = _fields(raw, "SamplingParams", _SAMPLING_SCHEMA)
        given = {k: checked[k] for k in raw}
        for key, message in sampling_problems(given):
            raise ConfigError(f"SamplingParams.{key}: {message}")
        if "response_format" in raw:
            try:
                response_format_json(raw["response_format"])
            except ValueError as e:
                raise ConfigError(f"SamplingParams.response_format: {e}") from None
        return raw

    def __repr__(self) -> str:
        return "SamplingParams(" + ", ".join(f"{k}={v!r}" for k, v in self.set_fields().items()) + ")"


def sampling_list(sampling_params: Any, count: int) -> list[tuple[str, dict]]:
    """One (label for errors, job.yaml sampling mapping) per prompt.

    ``sampling_params``: None (all defaults), a SamplingParams, a job.yaml sampling dict, or a
    list of those with one entry per prompt.
    """
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != count:
            raise ConfigError(f"sampling_params: a list of {len(sampling_params)} for {count} prompt(s); give one "
                              "SamplingParams for all prompts, or exactly one per prompt")
        return [_one(p, f"sampling_params[{i}]") for i, p in enumerate(sampling_params)]
    return [_one(sampling_params, "sampling_params")] * count


def _one(p: Any, label: str) -> tuple[str, dict]:
    if p is None:
        return label, {}
    if isinstance(p, SamplingParams):
        return label, p.to_job_sampling()
    if isinstance(p, dict):
        return label, dict(p)
    raise ConfigError(f"{label}: expected a batchrun.SamplingParams or a dict of job.yaml sampling fields, "
                      f"got {type(p).__name__}")


def sampling_key(raw: dict) -> str:
    """A hashable form of a sampling mapping: prompts with equal settings share one parse."""
    return json.dumps(raw, sort_keys=True, default=repr)


def _is_default(value: Any, default: Any) -> bool:
    """vLLM's default, or an empty list/dict where the default is None (also a no-op)."""
    if isinstance(default, bool):
        return value is default
    if default is None:
        return value is None or (isinstance(value, (list, tuple, dict)) and not value)
    return value == default
