"""Input rows -> engine requests (or error results), and results -> an output table.

A row that cannot run becomes an error result here, with a message a user can act on:
null/empty prompt, prompt + max_tokens over engine.max_model_len, unknown adapter, bad
per-row sampling override, or whatever the engine's own check_request says.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import pyarrow as pa

from batchrun.config import SamplingParams
from batchrun.engine.request import Request, Result
from batchrun.inputs import INVALID, InvalidText
from batchrun.job import OVERRIDE_COLUMNS, JobSpec
from batchrun.short_repr import short_repr
from batchrun.output import output_schema
from batchrun.plan import Plan, Unit


def row_seed(job_seed: int, row_id: Any) -> int:
    """A row's sampling seed: stable across reruns, task splits and batch-mates."""
    digest = hashlib.blake2b(f"{job_seed}:{row_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def input_columns(spec: JobSpec, plan: Plan) -> list[str]:
    inp = spec.input
    cols = [c for c in (inp.id_column, inp.prompt_column, inp.messages_column, inp.adapter_column) if c]
    return list(dict.fromkeys(cols + list(plan.override_columns)))


@dataclass
class UnitWork:
    unit: Unit
    ids: list
    results: list[Result | None]
    requests: list[Request] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return sum(r is None for r in self.results)

    def first_error(self) -> tuple[Any, str] | None:
        for row_id, r in zip(self.ids, self.results):
            if r is not None and r.finish_reason == "error":
                return row_id, r.error
        return None


def _sampling(spec: JobSpec, rows: dict[str, list], pos: int, row_id: Any) -> SamplingParams:
    s = spec.sampling
    values = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
              "top_k": s.top_k, "seed": None}
    for col in OVERRIDE_COLUMNS:
        if col in rows and rows[col][pos] is not None:
            values[col] = rows[col][pos]
    if values["seed"] is None:
        values["seed"] = row_seed(s.seed, row_id)
    for col in ("max_tokens", "top_k", "seed"):
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
    return SamplingParams(max_tokens=int(values["max_tokens"]), temperature=float(values["temperature"]),
                          top_p=float(values["top_p"]), top_k=int(values["top_k"]), seed=int(values["seed"]))


def _token_ids(encoded) -> list[int]:
    # apply_chat_template(tokenize=True) returns a list in some transformers versions and a
    # BatchEncoding/dict in others.
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def build_unit(unit: Unit, rows: dict[str, list], row_file, row_index, plan: Plan, spec: JobSpec,
               tokenizer, max_model_len: int, check_request: Callable[[Request], str | None]) -> UnitWork:
    inp = spec.input
    n = unit.rows
    if inp.id_column:
        ids = rows[inp.id_column]
    else:
        ids = [f"{plan.file_names[int(f)]}:{int(r)}" for f, r in zip(row_file, row_index)]
    names = rows[inp.adapter_column] if inp.adapter_column else [None] * n
    work = UnitWork(unit, ids, [None] * n)

    def fail(pos: int, msg: str, prompt_tokens: int = 0) -> None:
        work.results[pos] = Result((unit.index, pos), names[pos] or None, prompt_tokens, [], None, "error", msg)

    samplings: list[SamplingParams | None] = [None] * n
    texts: dict[int, str] = {}
    chats: dict[int, list] = {}
    for pos in range(n):
        if not unit.known:
            configured = ", ".join(spec.adapters) or "none"
            fail(pos, f"unknown adapter {short_repr(str(names[pos]))} (configured adapters: {configured})")
            continue
        try:
            samplings[pos] = _sampling(spec, rows, pos, ids[pos])
        except (ValueError, TypeError) as e:
            fail(pos, f"bad per-row sampling override: {e}")
            continue
        if inp.prompt_column:
            text = rows[inp.prompt_column][pos]
            if text is None:
                fail(pos, f"prompt is null (column {inp.prompt_column!r})")
            elif isinstance(text, InvalidText):
                fail(pos, f"prompt is not valid UTF-8 (column {inp.prompt_column!r})")
            elif not text.strip():
                fail(pos, f"prompt is empty (column {inp.prompt_column!r})")
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
                chats[pos] = msgs

    tokens: dict[int, list[int]] = {}
    if texts:
        order = list(texts)
        for pos, ids_ in zip(order, tokenizer([texts[p] for p in order])["input_ids"]):
            tokens[pos] = list(ids_)
    for pos, msgs in chats.items():
        try:
            tokens[pos] = _token_ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
        except Exception as e:  # a template can raise anything (jinja errors, role checks)
            fail(pos, f"chat template failed: {e}")

    for pos in sorted(tokens):
        ids_, sp = tokens[pos], samplings[pos]
        if not ids_:
            fail(pos, "prompt tokenizes to no tokens")
            continue
        if len(ids_) + sp.max_tokens > max_model_len:
            fail(pos, f"prompt has {len(ids_)} tokens; with max_tokens {sp.max_tokens} that exceeds "
                      f"engine.max_model_len {max_model_len}", len(ids_))
            continue
        req = Request((unit.index, pos), ids_, sp, unit.adapter)
        msg = check_request(req)
        if msg:
            fail(pos, msg, len(ids_))
            continue
        work.requests.append(req)
    return work


def unit_table(work: UnitWork, id_type: pa.DataType) -> pa.Table:
    res = work.results
    return pa.table({
        "id": pa.array(work.ids, id_type),
        "adapter": pa.array([r.adapter or None for r in res], pa.string()),
        "output_text": pa.array([r.output_text if r.finish_reason != "error" else None for r in res], pa.string()),
        "output_token_ids": pa.array([r.output_token_ids for r in res], pa.list_(pa.int32())),
        "prompt_tokens": pa.array([r.prompt_tokens for r in res], pa.int32()),
        "output_tokens": pa.array([len(r.output_token_ids) for r in res], pa.int32()),
        "finish_reason": pa.array([r.finish_reason for r in res], pa.string()),
        "error": pa.array([r.error if r.finish_reason == "error" else None for r in res], pa.string()),
    }, schema=output_schema(id_type))
