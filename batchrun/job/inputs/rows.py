"""Input rows -> engine requests (or error results), and results -> an output table.

A row that cannot run becomes an error result here, with a message a user can act on:
null/empty prompt, unknown adapter, bad per-row sampling override, or what the engine's
check_request (request_check.py: too long, token ids, response_format, ...) says.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pyarrow as pa

from batchrun.job.inputs import arrow_types

from batchrun.job.inputs import prompts
from batchrun.engine.config import SamplingParams
from batchrun.engine.request import Request, Result
from batchrun.job.inputs.files import ARROW, INVALID, InvalidText
from batchrun.job.jobfile.spec import JobSpec, response_format_json, sampling_problems
from batchrun.common.short_repr import short_repr
from batchrun.job.store.layout import OPTIONAL_COLUMNS, output_schema
from batchrun.job.plan.units import Plan, Unit


def row_seed(job_seed: int, row_id: Any, sample_index: int = 0) -> int:
    """A row's sampling seed: stable across reruns, task splits and batch-mates.

    Sample k > 0 of a row (sampling.n) hashes (job seed, row id, k); sample 0 keeps the n = 1 seed.
    """
    key = f"{job_seed}:{row_id!r}" + (f":{sample_index}" if sample_index else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def sample_seed(row_seed_value: int, sample_index: int) -> int:
    """Sample k of a row whose seed is given (a seed override column): derived from (seed, k)."""
    if not sample_index:
        return row_seed_value
    digest = hashlib.blake2b(f"{row_seed_value}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def input_columns(spec: JobSpec, plan: Plan) -> list[str]:
    inp = spec.input
    cols = [c for c in (inp.id_column, inp.prompt_column, inp.messages_column, inp.prompt_token_ids_column,
                        inp.adapter_column) if c]
    return list(dict.fromkeys(cols + list(plan.override_columns)))


def arrow_columns(plan: Plan) -> list[str]:
    """Input columns read as Arrow data and copied unchanged into the output (passthrough)."""
    return list(getattr(plan, "passthrough_columns", None) or [])


@dataclass
class UnitWork:
    """One unit's rows; with sampling.n > 1, slot ``row * n + k`` is sample k of a row."""
    unit: Unit
    ids: list  # one per slot (a row's id repeated n times)
    results: list[Result | None]
    requests: list[Request] = field(default_factory=list)
    n: int = 1
    passthrough: dict = field(default_factory=dict)  # name -> ChunkedArray, one value per input row
    columns: frozenset = frozenset()  # optional output columns (optional_columns)

    @property
    def remaining(self) -> int:
        return sum(r is None for r in self.results)

    def first_error(self) -> tuple[Any, str] | None:
        for row_id, r in zip(self.ids, self.results):
            if r is not None and r.finish_reason == "error":
                return row_id, r.error
        return None


_INT_FIELDS = ("max_tokens", "top_k", "seed", "min_tokens", "logprobs")


def _sampling(spec: JobSpec, rows: dict[str, list], pos: int, row_id: Any,
              override_columns=None) -> SamplingParams:
    """The row's SamplingParams (sample 0): job values, then its non-null override columns."""
    s = spec.sampling
    values = {k: getattr(s, k) for k in (
        "max_tokens", "temperature", "top_p", "top_k", "stop", "include_stop_str_in_output",
        "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logprobs", "response_format")}
    values["seed"] = None
    cols = override_columns if override_columns is not None else [c for c in values if c in rows]
    for col in cols:
        if col in rows and rows[col][pos] is not None:
            values[col] = rows[col][pos]
    if values["seed"] is None:
        values["seed"] = row_seed(s.seed, row_id)
    for col in _INT_FIELDS:
        if isinstance(values[col], float):
            raise ValueError(f"{col} must be an integer, got {values[col]!r}")
    # Range checks here rather than only in SamplingParams: NaN passes "temperature < 0" and would
    # sample garbage. Same wording as SamplingParams, plus "finite" for the float fields.
    t, p = values["temperature"], values["top_p"]
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
    if not (math.isfinite(p) and 0 < p <= 1):
        raise ValueError(f"top_p must be a finite number in (0, 1], got {p!r}")
    if values["top_k"] < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {values['top_k']!r}")
    if values["max_tokens"] < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {values['max_tokens']!r}")
    for key, message in sampling_problems(values):
        raise ValueError(f"{key} {message}")
    stop = values["stop"]
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not x for x in stop):
        raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
    stop_ids = tuple(values["stop_token_ids"])
    if any(x is None or x < 0 for x in stop_ids):
        raise ValueError(f"stop_token_ids must be token ids >= 0, got {list(stop_ids)!r}")
    fmt = values["response_format"]
    if fmt is not None and fmt is not s.response_format:
        try:
            fmt = response_format_json(fmt)
        except ValueError as e:
            raise ValueError(f"response_format {e}") from None
    return SamplingParams(
        max_tokens=int(values["max_tokens"]), temperature=float(t), top_p=float(p),
        top_k=int(values["top_k"]), seed=int(values["seed"]), stop_token_ids=stop_ids,
        ignore_eos=bool(values["ignore_eos"]), stop=stop,
        include_stop_str_in_output=bool(values["include_stop_str_in_output"]),
        min_tokens=int(values["min_tokens"]), presence_penalty=float(values["presence_penalty"]),
        frequency_penalty=float(values["frequency_penalty"]),
        repetition_penalty=float(values["repetition_penalty"]),
        logprobs=None if values["logprobs"] is None else int(values["logprobs"]), response_format=fmt)


def build_unit(unit: Unit, rows: dict[str, list], row_file, row_index, plan: Plan, spec: JobSpec,
               tokenizer, check_request: Callable[[Request], str | None]) -> UnitWork:
    """The unit's requests, and an error result for each row that cannot run: what this module
    finds (prompt, override, adapter) or what ``check_request`` says (the engine's
    ``check_request(req, job=True)``: request_check.py, with job.yaml's field names)."""
    inp = spec.input
    n = unit.rows
    if inp.id_column:
        ids = rows[inp.id_column]
    else:
        ids = [f"{plan.file_names[int(f)]}:{int(r)}" for f, r in zip(row_file, row_index)]
    names = rows[inp.adapter_column] if inp.adapter_column else [None] * n
    k_n = spec.sampling.n
    work = UnitWork(unit, [i for i in ids for _ in range(k_n)], [None] * (n * k_n), n=k_n,
                    passthrough=rows.get(ARROW) or {}, columns=optional_columns(spec, plan))

    def fail(pos: int, msg: str, prompt_tokens: int = 0) -> None:
        for k in range(k_n):
            slot = pos * k_n + k
            work.results[slot] = Result((unit.index, slot), names[pos] or None, prompt_tokens, [], None,
                                        "error", msg)

    samplings: list[SamplingParams | None] = [None] * n
    texts: dict[int, str] = {}
    chats: dict[int, list] = {}
    token_lists: dict[int, list[int]] = {}
    for pos in range(n):
        if not unit.known:
            configured = ", ".join(spec.adapters) or "none"
            fail(pos, f"unknown adapter {short_repr(str(names[pos]))} (configured adapters: {configured})")
            continue
        try:
            samplings[pos] = _sampling(spec, rows, pos, ids[pos], plan.override_columns)
        except (ValueError, TypeError) as e:
            fail(pos, f"bad per-row sampling override: {e}")
            continue
        if inp.prompt_token_ids_column:
            given = rows[inp.prompt_token_ids_column][pos]
            if not given or any(t is None for t in given):
                fail(pos, f"prompt token ids are {'null' if given is None else 'empty or hold a null'} "
                          f"(column {inp.prompt_token_ids_column!r})")
            else:
                token_lists[pos] = list(given)
        elif inp.prompt_column:
            text = rows[inp.prompt_column][pos]
            if text is None:
                fail(pos, f"prompt is null (column {inp.prompt_column!r})")
            elif isinstance(text, InvalidText):
                fail(pos, f"prompt is not valid UTF-8 (column {inp.prompt_column!r})")
            elif not text.strip():
                fail(pos, f"prompt is empty (column {inp.prompt_column!r})")
            elif inp.system_prompt is not None:
                chats[pos] = prompts.chat_messages(inp, prompt=text)
            else:
                texts[pos] = text
        else:
            msgs = rows[inp.messages_column][pos]
            if msgs is INVALID:
                fail(pos, f"messages are not valid UTF-8 (column {inp.messages_column!r})")
            elif not msgs:
                fail(pos, f"messages are {'null' if msgs is None else 'empty'} (column {inp.messages_column!r})")
            elif any(not m or m.get("role") is None or m.get("content") is None for m in msgs):
                fail(pos, f"a message has a null role or content (column {inp.messages_column!r})")
            else:
                chats[pos] = prompts.chat_messages(inp, messages=msgs)

    tokens: dict[int, list[int]] = dict(token_lists)
    if texts:
        order = list(texts)
        for pos, ids_ in zip(order, prompts.text_token_ids(tokenizer, inp, [texts[p] for p in order])):
            tokens[pos] = ids_
    for pos, msgs in chats.items():
        try:
            tokens[pos] = prompts.chat_token_ids(tokenizer, inp, msgs)
        except Exception as e:  # a template can raise anything (jinja errors, role checks)
            fail(pos, f"chat template failed: {e}")

    for pos in sorted(tokens):
        ids_, sp = tokens[pos], samplings[pos]
        req = Request((unit.index, pos * k_n), ids_, sp, unit.adapter, checked=True)
        msg = check_request(req)  # the engine's request_check.request_problem, job.yaml's names
        if msg:
            fail(pos, msg, len(ids_))
            continue
        work.requests.append(req)
        seeded = "seed" in plan.override_columns and rows["seed"][pos] is not None
        for k in range(1, k_n):  # the other samples: same prompt, own seed from (seed, id, k)
            seed = sample_seed(sp.seed, k) if seeded else row_seed(spec.sampling.seed, ids[pos], k)
            work.requests.append(Request((unit.index, pos * k_n + k), ids_, replace(sp, seed=seed), unit.adapter,
                                         checked=True))
    return work


def optional_columns(spec: JobSpec, plan: Plan) -> frozenset:
    """The output's optional columns, the same for every unit of a job: sample_index when
    sampling.n > 1; stop_reason when stop strings or stop_token_ids are set (job or row); logprobs
    and top_logprobs when sampling.logprobs is set or a logprobs override column exists."""
    s, over = spec.sampling, set(plan.override_columns)
    cols = set()
    if s.n > 1:
        cols.add("sample_index")
    if s.stop or s.stop_token_ids or over & {"stop", "stop_token_ids"}:
        cols.add("stop_reason")
    if s.logprobs is not None or "logprobs" in over:
        cols |= {"logprobs", "top_logprobs"}
    return frozenset(cols)


def unit_table(work: UnitWork, id_type: pa.DataType) -> pa.Table:
    res = work.results
    ok = [r.finish_reason != "error" for r in res]
    cols = {
        "id": pa.array(work.ids, id_type),
        "adapter": pa.array([r.adapter or None for r in res], pa.string()),
        "sample_index": pa.array([i % work.n for i in range(len(res))], pa.int32()),
        "output_text": pa.array([r.output_text if good else None for r, good in zip(res, ok)], pa.string()),
        "output_token_ids": pa.array([r.output_token_ids for r in res], pa.list_(pa.int32())),
        "prompt_tokens": pa.array([r.prompt_tokens for r in res], pa.int32()),
        "output_tokens": pa.array([len(r.output_token_ids) for r in res], pa.int32()),
        "finish_reason": pa.array([r.finish_reason for r in res], pa.string()),
        "stop_reason": pa.array([None if r.stop_reason is None else str(r.stop_reason) for r in res], pa.string()),
        "error": pa.array([r.error if not good else None for r, good in zip(res, ok)], pa.string()),
        "logprobs": pa.array([r.logprobs for r in res], OPTIONAL_COLUMNS["logprobs"]),
        "top_logprobs": pa.array([None if r.top_logprobs is None else
                                  [[{"token_id": t, "logprob": v} for t, v in step] for step in r.top_logprobs]
                                  for r in res], OPTIONAL_COLUMNS["top_logprobs"]),
    }
    extra = {}
    if work.passthrough:
        take = pa.array([i // work.n for i in range(len(res))], pa.int64())
        extra = {name: arrow_types.take(col, take) for name, col in work.passthrough.items()}
    schema = output_schema(id_type, work.columns, [(name, col.type) for name, col in extra.items()])
    data = {name: cols[name] if name in cols else extra[name] for name in schema.names}
    return pa.table(data, schema=schema)
