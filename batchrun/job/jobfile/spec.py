"""job.yaml -> JobSpec: parse and validate.

Size (~500 lines): every section of job.yaml (model, adapters, input, output, sampling, engine)
is parsed with the same field checker so that every message has one form; the engine section
itself is EngineConfig's (engine/config.py). It is long because the job file is wide, not
because it does several jobs.

Every error names the field path (``engine.max_num_seqs``) and what was expected, because the
person reading it is looking at the YAML file, not at this code. Relative paths resolve against
the job file's directory; ``$VARS`` and ``~`` are expanded (handy for ``$SCRATCH`` on clusters),
and a reference to an unset variable is an error rather than a literal ``$SCRATCH`` folder.
Messages quote user values through a bounded repr (short_repr.py), and YAML that expands
(through aliases) past a bound is refused before it is built (safe_yaml.py).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from batchrun.engine.config import TYPE_NAMES as _TYPE_NAMES, EngineConfig, job_engine_fields
from batchrun.engine.config import removed_key_message
from batchrun.engine.config import finite_float, show as _show, type_ok as _type_ok
from batchrun.errors import ConfigError
from batchrun.job.run.error_rate import check_rate
from batchrun.job.jobfile.text import check_text, decode_job_file, text_problem
from batchrun.job.jobfile.safe_yaml import load_yaml
from batchrun.job.storage.options import StorageOptions, parse_storage_options
from batchrun.job.storage.uri import is_uri, parse_uri
from batchrun.common.short_repr import short_repr as _short

ON_ERROR = ("skip", "fail")
# A job file is a small mapping; anything that expands past this many values (counting every
# use of a YAML alias) is refused before it is built, so an alias bomb cannot exhaust memory.
# Input columns that, when present, override the job's sampling defaults row by row
# (sampling.overrides: auto = every one of these the input has; a list = only those).
OVERRIDE_COLUMNS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                    "include_stop_str_in_output", "stop_token_ids", "ignore_eos", "min_tokens",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                    "response_format")
# Sampling fields that are job-level only: a row cannot change how many output rows it has (n).
JOB_ONLY_SAMPLING = ("n",)
RESPONSE_FORMATS = ("json_schema", "json_object", "regex")
MAX_LOGPROBS = 20  # the cap on sampling.logprobs (vLLM's default max_logprobs)
# Keys of a model's generation_config.json used as sampling defaults (as vLLM's
# generation_config="auto"): job.yaml wins over them, per-row columns over both.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class InputSpec:
    path: str  # absolute: a file, a directory or a glob
    id_column: str | None = None  # None: "<file>:<row>" ids
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    adapter_column: str | None = None  # None: every row runs on the base model
    rows_per_unit: int = 1024  # a work unit = one part file = one commit
    passthrough_columns: tuple[str, ...] | str = ()  # copied into the output; "*" = all input columns
    prompt_token_ids_column: str | None = None  # list<int> prompts: no tokenizer needed
    system_prompt: str | None = None  # prompt_column rows render [system, user] through the chat template
    chat_template_kwargs: dict = field(default_factory=dict)  # passed to the chat template
    add_special_tokens: bool | str = "auto"  # auto: none after a chat template, else the tokenizer's default
    storage_options: StorageOptions = field(default_factory=StorageOptions)  # for an s3:// path


@dataclass(frozen=True)
class OutputSpec:
    path: str  # absolute directory
    storage_options: StorageOptions = field(default_factory=StorageOptions)


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # job seed; each row's seed is derived from it and the row id
    n: int = 1  # samples per row: one output row each, with sample_index
    stop: tuple[str, ...] = ()  # the output ends before the first match
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens
    logprobs: int | None = None  # None = no logprob columns; k: each token's logprob + the top k
    response_format: str | None = None  # canonical JSON of {type: json_schema|json_object|regex, ...}
    overrides: tuple[str, ...] | str = "auto"  # auto | the override column names to use
    from_generation_config: tuple[str, ...] = ()  # fields whose value came from generation_config.json


@dataclass(frozen=True)
class JobSpec:
    job_file: str  # absolute path of the YAML file ("" when built from a dict)
    model: str
    adapters: dict[str, str]
    input: InputSpec
    output: OutputSpec
    engine: EngineConfig  # its model is the job's model (parse_job fills it)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    on_error: str = "skip"
    max_error_rate: float | None = None  # None: fail (exit 10) only if every row failed; error_rate.py

    def to_dict(self) -> dict:
        return asdict(self)


# ---- field checking ---------------------------------------------------------------------------

def _fields(raw: Any, where: str, schema: dict[str, tuple[type, bool, Any]]) -> dict[str, Any]:
    """Check a mapping against ``{key: (type, nullable, default)}``; return the filled-in values.

    ``default`` is ``_REQUIRED`` for required keys.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'job file'}: expected a mapping, got {_show(raw)}")
    _known_keys(raw, where, schema)
    out = {}
    for key, (typ, nullable, default) in schema.items():
        path = f"{where}.{key}" if where else key
        if key not in raw:
            if default is _REQUIRED:
                raise ConfigError(f"{path}: required field is missing (expected {_TYPE_NAMES[typ]})")
            out[key] = default
            continue
        value = raw[key]
        if value is None and nullable:
            out[key] = None
        elif not _type_ok(value, typ):
            expected = _TYPE_NAMES[typ] + (" or null" if nullable else "")
            raise ConfigError(f"{path}: expected {expected}, got {_show(value)}")
        elif typ is float:
            number = finite_float(value)
            if number is None:
                raise ConfigError(f"{path}: must be a finite number, got {_show(value)}")
            out[key] = number
        else:
            out[key] = value
    return out


def _known_keys(raw: dict, where: str, allowed) -> None:
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        key = f"{where}.{_key(unknown[0])}" if where else _key(unknown[0])
        raise ConfigError(f"{key}: unknown field (allowed under {where or 'the top level'}: {', '.join(allowed)})")


class _Required:
    def __repr__(self):
        return "<required>"


_REQUIRED = _Required()




def _key(key: Any) -> str:
    """A mapping key as it appears in a field path: short strings as written, the rest bounded."""
    if isinstance(key, str) and len(key) <= 60 and key.isprintable():
        return key
    return _short(key)


def _check(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{path}: {message}")


# The references os.path.expandvars expands on POSIX ($NAME, ${NAME}); it leaves unset ones as
# they are, which would silently create a directory literally named "$SCRATCH".
_ENV_REF = re.compile(r"\$(\w+|\{[^}/]*\})", re.ASCII)


def _resolve(base: Path, value: str, path: str) -> str:
    _check(value.strip() != "", path, "must not be empty")
    for m in _ENV_REF.finditer(value):
        name = m.group(1).strip("{}")
        if name not in os.environ:
            ref = m.group(0) if len(m.group(0)) <= 60 else m.group(0)[:57] + "..."
            raise ConfigError(f"{path}: environment variable {ref} is not set (in {_short(value)}); "
                              "set it or write the path out")
    p = Path(os.path.expanduser(os.path.expandvars(value)))
    if (why := text_problem(str(p))) is not None:  # an environment value of non-UTF-8 bytes
        raise ConfigError(f"{path}: {_short(value)} expands to a path that {why}; batchrun needs paths "
                          "that are valid text: rename the directory or set the variable to another path")
    if not p.is_absolute():
        p = base / p
    return os.path.normpath(str(p))


def _resolve_data(base: Path, value: str, path: str) -> str:
    """input.path / output.path: a local path (resolved as above) or an s3:// URI kept as written."""
    _check(value.strip() != "", path, "must not be empty")
    if is_uri(value):
        parse_uri(value, path)  # a scheme batchrun reads, with a bucket
        return value
    return _resolve(base, value, path)


def _resolve_local(base: Path, value: str, path: str, what: str) -> str:
    """model / adapters: local paths only (batchrun loads them with local file reads)."""
    if is_uri(value):
        shown = value if len(value) <= 200 else _short(value)
        raise ConfigError(f"{path}: {shown} is a URI; {what} must be a local path (batchrun does not "
                          "fetch models or adapters from object storage): copy it to local disk first "
                          "(`aws s3 sync URI DIR`, `gcloud storage cp -r URI DIR`) and give that path")
    return _resolve(base, value, path)


# ---- parsing ----------------------------------------------------------------------------------

def load_job(path: str | os.PathLike) -> JobSpec:
    """Read and validate a job file. Raises ConfigError naming the file and field."""
    path = Path(path).absolute()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read job file {path}: {e.strerror or e}") from None
    try:
        text = decode_job_file(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    try:
        raw = load_yaml(text)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except yaml.YAMLError as e:
        msg = str(e)
        if len(msg) > 600:  # marks are bounded snippets, but a problem text can quote a huge tag
            msg = msg[:597] + "..."
        raise ConfigError(f"{path}: not valid YAML: {msg}") from None
    try:
        return parse_job(raw, base_dir=path.parent, job_file=str(path))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def parse_job(raw: Any, base_dir: str | os.PathLike, job_file: str = "") -> JobSpec:
    """Validate an already-parsed job mapping; relative paths resolve against ``base_dir``."""
    base = Path(base_dir).absolute()
    check_text(raw)  # NUL, lone surrogates: job_text.py
    top = _fields(raw, "", {
        "model": (str, False, _REQUIRED),
        "adapters": (dict, True, None),
        "input": (dict, False, _REQUIRED),
        "output": (dict, False, _REQUIRED),
        "sampling": (dict, True, None),
        "engine": (dict, True, None),
        "on_error": (str, False, "skip"),
        "max_error_rate": (object, True, None),
    })
    model = _resolve_local(base, top["model"], "model", "the model directory")

    adapters: dict[str, str] = {}
    for name, apath in (top["adapters"] or {}).items():
        where = f"adapters.{_key(name)}"
        _check(isinstance(name, str) and name.strip() != "", where,
               "adapter names must be non-empty strings")
        _check(isinstance(apath, str), where,
               f"expected a string (the PEFT adapter directory), got {_show(apath)}")
        adapters[name] = _resolve_local(base, apath, where, "adapter directories")

    inp = _fields(top["input"], "input", {
        "path": (str, False, _REQUIRED),
        "id_column": (str, True, None),
        "prompt_column": (str, True, None),
        "messages_column": (str, True, None),
        "adapter_column": (str, True, None),
        "rows_per_unit": (int, False, 1024),
        "passthrough_columns": (object, True, None),
        "prompt_token_ids_column": (str, True, None),
        "system_prompt": (str, True, None),
        "chat_template_kwargs": (dict, True, None),
        "add_special_tokens": (object, False, "auto"),
        "storage_options": (dict, True, None),
    })
    inp["storage_options"] = parse_storage_options(inp["storage_options"], "input.storage_options")
    inp["passthrough_columns"] = _passthrough(inp["passthrough_columns"])
    inp["chat_template_kwargs"] = dict(inp["chat_template_kwargs"] or {})
    _check(inp["add_special_tokens"] == "auto" or isinstance(inp["add_special_tokens"], bool), "input.add_special_tokens",
           f"expected auto, true or false, got {_show(inp['add_special_tokens'])}")
    sources = [k for k in ("prompt_column", "messages_column", "prompt_token_ids_column") if inp[k] is not None]
    if not sources:
        inp["prompt_column"] = "prompt"
    _check(not (inp["prompt_column"] and inp["messages_column"]), "input",
           "set either prompt_column (text prompts) or messages_column (chat messages), not both")
    _check(len(sources) <= 1, "input", "set one of prompt_column (text), messages_column (chat messages) or "
           f"prompt_token_ids_column (token ids), not several (got {', '.join(sources)})")
    if inp["prompt_token_ids_column"] is not None:
        for key in ("system_prompt", "chat_template_kwargs"):
            _check(not inp[key], f"input.{key}", "has no effect with prompt_token_ids_column "
                   "(the prompts are token ids already); remove it")
    if inp["system_prompt"] is not None:
        _check(inp["system_prompt"].strip() != "", "input.system_prompt", "must not be empty (use null)")
    _check(inp["rows_per_unit"] >= 1, "input.rows_per_unit", "must be >= 1")
    for key in ("id_column", "prompt_column", "messages_column", "adapter_column", "prompt_token_ids_column"):
        if inp[key] is not None:
            _check(inp[key] != "", f"input.{key}", "must not be empty (use null to leave it unset)")
    _check(not adapters or inp["adapter_column"] is not None, "input.adapter_column",
           "adapters are configured but no column names each row's adapter; set "
           "input.adapter_column (rows with null or \"\" run on the base model)")
    inp["path"] = _resolve_data(base, inp["path"], "input.path")

    out = _fields(top["output"], "output", {"path": (str, False, _REQUIRED), "storage_options": (dict, True, None)})
    out["storage_options"] = parse_storage_options(out["storage_options"], "output.storage_options")
    out["path"] = _resolve_data(base, out["path"], "output.path")
    if is_uri(out["path"]):
        out["path"] = out["path"].rstrip("/")  # a prefix: s3://b/out and s3://b/out/ are one output

    smp = parse_sampling(top["sampling"], model)

    eng = parse_engine(top["engine"], model, bool(adapters), smp.seed)
    check_max_tokens(smp, eng.max_model_len)

    _check(top["on_error"] in ON_ERROR, "on_error",
           f"expected skip (bad rows become error rows) or fail (stop the job), got {_short(top['on_error'])}")
    try:
        max_error_rate = check_rate(top["max_error_rate"], "max_error_rate")
    except ValueError as e:
        raise ConfigError(str(e)) from None

    return JobSpec(
        job_file=job_file, model=model, adapters=adapters,
        input=InputSpec(**inp), output=OutputSpec(**out),
        sampling=smp, engine=eng, on_error=top["on_error"], max_error_rate=max_error_rate,
    )


def parse_engine(raw: Any, model: str, enable_lora: bool, seed: int) -> EngineConfig:
    """engine: -> EngineConfig (which checks the values); the job decides model, enable_lora
    (adapters configured) and seed (sampling.seed)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"engine: expected a mapping, got {_show(raw)}")
    for key, value in raw.items():
        removed = removed_key_message(key, value) if isinstance(key, str) else None
        if removed:
            raise ConfigError(f"engine.{removed}")
    _known_keys(raw, "engine", job_engine_fields())
    # a job's default max_num_seqs is auto (sized from the KV cache when the engine starts)
    raw = {"max_num_seqs": "auto", **raw}
    return EngineConfig(model=model, enable_lora=enable_lora, seed=seed, **raw)


def check_max_tokens(smp: SamplingSpec, max_model_len: int | str, auto: bool = False) -> None:
    """A job's max_tokens must leave room for a prompt in max_model_len. "auto" is checked once
    the model's context is known (prepare.check_model_and_adapters passes it, ``auto`` True)."""
    if max_model_len == "auto":
        return
    shown = f"{max_model_len}, auto: the model's context" if auto else max_model_len
    _check(smp.max_tokens < max_model_len, "sampling.max_tokens",
           ("(from the model's generation_config.json max_new_tokens) " if "max_tokens" in smp.from_generation_config else "") +
           f"must be smaller than engine.max_model_len ({shown}) to leave room for the prompt")


# ---- input.passthrough_columns and the sampling section ---------------------------------------

def _passthrough(value: Any) -> tuple[str, ...] | str:
    where = "input.passthrough_columns"
    if value is None:
        return ()
    if value == "*":
        return "*"
    _check(isinstance(value, list) and all(isinstance(c, str) and c != "" for c in value), where,
           f'expected a list of column names or "*" (all input columns), got {_show(value)}')
    _check(len(set(value)) == len(value), where, f"lists a column twice: {_short(value)}")
    return tuple(value)


def _str_list(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    _check(isinstance(value, list) and all(isinstance(v, str) and v != "" for v in value), path,
           f"expected a string or a list of non-empty strings, got {_show(value)}")
    return tuple(value)


def _int_list(value: Any, path: str) -> tuple[int, ...]:
    _check(isinstance(value, list) and all(_type_ok(v, int) and v >= 0 for v in value), path,
           f"expected a list of token ids (integers >= 0), got {_show(value)}")
    return tuple(value)


_SAMPLING_SCHEMA = {
    "max_tokens": (int, False, 64),
    "temperature": (float, False, 0.0),
    "top_p": (float, False, 1.0),
    "top_k": (int, False, 0),
    "seed": (int, False, 0),
    "n": (int, False, 1),
    "stop": (object, True, None),
    "include_stop_str_in_output": (bool, False, False),
    "stop_token_ids": (list, True, None),
    "ignore_eos": (bool, False, False),
    "min_tokens": (int, False, 0),
    "presence_penalty": (float, False, 0.0),
    "frequency_penalty": (float, False, 0.0),
    "repetition_penalty": (float, False, 1.0),
    "logprobs": (int, True, None),
    "response_format": (dict, True, None),
    "overrides": (object, False, "auto"),
}


def generation_config_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults a model directory's generation_config.json sets ({} without one)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    import json
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read it as JSON ({e}); fix or remove the file "
                          "(it sets the model's default sampling settings)") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    out = {}
    for key, field_name in GENERATION_CONFIG_KEYS.items():
        if raw.get(key) is not None:
            out[field_name] = raw[key]
    return out


def parse_sampling(raw: Any, model_dir: str) -> SamplingSpec:
    """sampling: -> SamplingSpec; fields job.yaml leaves out take generation_config.json's value."""
    explicit = set(raw or {}) if isinstance(raw, dict) else set()
    smp = _fields(raw, "sampling", _SAMPLING_SCHEMA)
    from_gc = []
    for key, value in generation_config_defaults(model_dir).items():
        if key in explicit:
            continue
        typ = _SAMPLING_SCHEMA[key][0]
        if not _type_ok(value, typ):
            raise ConfigError(f"{Path(model_dir) / 'generation_config.json'}: {key} must be "
                              f"{_TYPE_NAMES[typ]}, got {_show(value)}; set sampling.{key} in the job "
                              "file to override it")
        smp[key] = float(value) if typ is float else value
        from_gc.append(key)
    smp["from_generation_config"] = tuple(from_gc)
    smp["stop"] = _str_list(smp["stop"] if smp["stop"] is not None else [], "sampling.stop")
    smp["stop_token_ids"] = _int_list(smp["stop_token_ids"] or [], "sampling.stop_token_ids")
    src = {k: " (from the model's generation_config.json)" for k in from_gc}
    for key, message in sampling_problems(smp):
        raise ConfigError(f"sampling.{key}: {message}{src.get(key, '')}")
    if smp["response_format"] is not None:
        try:
            smp["response_format"] = response_format_json(smp["response_format"])
        except ValueError as e:
            raise ConfigError(f"sampling.response_format: {e}") from None
    overrides = smp["overrides"]
    if overrides != "auto":
        _check(isinstance(overrides, list) and all(isinstance(c, str) for c in overrides),
               "sampling.overrides", f"expected auto, or a list of column names ([] = none), got {_show(overrides)}")
        for col in overrides:
            _check(col in OVERRIDE_COLUMNS, "sampling.overrides",
                   f"{_short(col)} is not a per-row sampling field (allowed: {', '.join(OVERRIDE_COLUMNS)})"
                   + ("; it is job-level only" if col in JOB_ONLY_SAMPLING else ""))
        smp["overrides"] = tuple(overrides)
    return SamplingSpec(**smp)


def sampling_problems(v: dict[str, Any]):
    """(field, message) for each bad value among the sampling fields in ``v`` (a job's or a row's).

    The range checks vLLM's SamplingParams makes; NaN fails them all (it compares false).
    """
    def bad(cond):
        return not cond
    checks = [
        ("max_tokens", lambda x: x >= 1, "must be >= 1"),
        ("temperature", lambda x: math.isfinite(x) and x >= 0, "must be a finite number >= 0 (0 = greedy)"),
        ("top_p", lambda x: math.isfinite(x) and 0 < x <= 1, "must be in (0, 1]"),
        ("top_k", lambda x: x >= 0, "must be >= 0 (0 = off)"),
        ("n", lambda x: x >= 1, "must be >= 1"),
        ("min_tokens", lambda x: x >= 0, "must be >= 0"),
        ("presence_penalty", lambda x: math.isfinite(x) and -2 <= x <= 2, "must be in [-2, 2]"),
        ("frequency_penalty", lambda x: math.isfinite(x) and -2 <= x <= 2, "must be in [-2, 2]"),
        ("repetition_penalty", lambda x: math.isfinite(x) and x > 0, "must be > 0 (1 = off)"),
        ("logprobs", lambda x: x is None or 0 <= x <= MAX_LOGPROBS,
         f"must be null (none) or an integer in [0, {MAX_LOGPROBS}]"),
    ]
    for key, ok, message in checks:
        if key in v and bad(ok(v[key])):
            yield key, f"{message}, got {_short(v[key])}"
    if "min_tokens" in v and "max_tokens" in v and v["min_tokens"] > v["max_tokens"]:
        yield "min_tokens", f"must be <= max_tokens ({v['max_tokens']}), got {v['min_tokens']}"


def sampling_summary(s: SamplingSpec, override_columns=()) -> list[str]:
    """`batchrun plan`: the effective sampling defaults, where each came from, and the override columns."""
    gc = set(s.from_generation_config)
    shown = []
    for key in ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "include_stop_str_in_output",
                "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "logprobs"):
        value = getattr(s, key)
        if isinstance(value, tuple):
            value = list(value)
        shown.append(f"{key}={value!r}" + (" (generation_config.json)" if key in gc else ""))
    lines = ["sampling: " + ", ".join(shown[:5]), "          " + ", ".join(shown[5:10]),
             "          " + ", ".join(shown[10:])]
    lines.append("          per-row overrides: " + (", ".join(override_columns) or "none")
                 + f" (sampling.overrides: {s.overrides if s.overrides == 'auto' else list(s.overrides)})")
    return lines


def response_format_json(value: Any) -> str:
    """A response_format mapping (or its JSON text, as a per-row column holds it) -> canonical JSON.

    ``{type: json_schema, schema: {...}}`` | ``{type: json_object}`` | ``{type: regex, pattern: "..."}``.
    Raises ValueError naming what is wrong; whether the schema compiles is the grammar engine's call.
    """
    import json
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping with a type ({', '.join(RESPONSE_FORMATS)}), got {_show(value)}")
    kind = value.get("type")
    need = {"json_schema": "schema", "json_object": None, "regex": "pattern"}
    if kind not in need:
        raise ValueError(f"type must be one of {', '.join(RESPONSE_FORMATS)}, got {_short(kind)}")
    allowed = {"type", need[kind]} - {None}
    extra = sorted(set(value) - allowed, key=str)
    if extra:
        raise ValueError(f"unknown key {_short(extra[0])} for type {kind} (allowed: {', '.join(sorted(allowed))})")
    if kind == "json_schema" and not isinstance(value.get("schema"), dict):
        raise ValueError(f"type json_schema needs schema: a JSON-schema mapping, got {_show(value.get('schema'))}")
    if kind == "regex" and not (isinstance(value.get("pattern"), str) and value["pattern"]):
        raise ValueError(f"type regex needs pattern: a non-empty string, got {_show(value.get('pattern'))}")
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot be written as JSON ({e})") from None
