"""The Python API: ``batchrun.run(job)`` and ``batchrun.LLM(model).generate(...)``.

Both are thin over the CLI's code: ``run`` is ``batchrun run`` in-process (same validation,
plan, resume, commits); ``LLM`` validates its settings as job.yaml fields (``parse_job``), loads
the engine the runner loads (``runner.load_engine``), and turns prompts into requests with the
runner's row builder (``rows.build_unit``), so a prompt, a sampling setting or a bad value gives
the same tokens or the same error as in a job.

    import batchrun
    llm = batchrun.LLM("demo/model", adapters={"upper": "demo/adapters/upper"}, device="cpu")
    out = llm.generate(["hello world"], {"max_tokens": 16, "n": 2, "temperature": 0.8}, adapters="upper")
    out[0].outputs[1].text
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from batchrun.errors import ConfigError
from batchrun.job.spec import JobSpec, check_max_tokens, load_job, parse_job, parse_sampling


def run(job: str | os.PathLike | dict, task_id: int = 0, num_tasks: int = 1, restart: bool = False,
        progress: bool | str = False, log=None):
    """Run a job file (path) or a job mapping (relative paths resolve against the current
    directory) like ``batchrun run``; returns the task's TaskStats. Raises ConfigError etc."""
    from batchrun.job.runner import run_job
    spec = parse_job(job, base_dir=os.getcwd()) if isinstance(job, dict) else load_job(job)
    return run_job(spec, task_id=task_id, num_tasks=num_tasks, restart=restart, progress=progress,
                   log=log or (lambda m: None))


@dataclass
class CompletionOutput:
    index: int  # sample index (0..n-1)
    text: str | None  # None without a tokenizer
    token_ids: list[int]
    finish_reason: str  # stop | length | error
    stop_reason: str | int | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestOutput:
    index: int  # position in the generate() call
    adapter: str | None
    prompt_tokens: int
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None  # set when the prompt could not run (outputs are then error rows)


_KINDS = {"text": "prompt", "messages": "messages", "ids": "prompt_token_ids"}


def _kind(prompt: Any) -> str:
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in prompt):
        return "ids"
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return "messages"
    raise ConfigError(f"generate: each prompt must be a string, a list of token ids or a list of "
                      f"{{role, content}} messages, got {type(prompt).__name__}")


class LLM:
    """An in-process engine. ``engine`` takes job.yaml's engine fields (device, dtype,
    max_model_len, max_num_seqs, ...); ``input`` its prompt options (system_prompt,
    chat_template_kwargs, add_special_tokens)."""

    def __init__(self, model: str | os.PathLike, adapters: dict[str, str] | None = None,
                 input: dict | None = None, **engine):
        raw = {"model": str(model), "adapters": dict(adapters or {}) or None,
               "input": {"path": "-", "id_column": "id", **(input or {}),
                         **({"adapter_column": "adapter"} if adapters else {})},
               "output": {"path": "-"}, "engine": engine}
        self.spec: JobSpec = parse_job(raw, base_dir=os.getcwd())
        from batchrun.job.prepare import check_model_and_adapters
        from batchrun.job.runner import load_engine
        check_model_and_adapters(self.spec)  # the pre-weights checks `batchrun run` makes
        self.engine = load_engine(self.spec)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Sequence | str, sampling: dict | None = None,
                 adapters: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Prompts (strings, token-id lists or message lists) -> one RequestOutput each, in order.

        ``sampling``: job.yaml's sampling fields (defaults from the model's
        generation_config.json, as in a job). ``adapters``: one name for all prompts, or one per
        prompt (None = base model).
        """
        from batchrun.job.plan import Unit
        from batchrun.job.rows import build_unit
        if isinstance(prompts, str) or (prompts and _kind_or_none(prompts) in ("ids", "messages")):
            prompts = [prompts]
        prompts = list(prompts)
        names = list(adapters) if isinstance(adapters, (list, tuple)) else [adapters] * len(prompts)
        if len(names) != len(prompts):
            raise ConfigError(f"generate: adapters has {len(names)} names for {len(prompts)} prompts")
        spec = replace(self.spec, sampling=parse_sampling(sampling or {}, self.spec.model))
        check_max_tokens(spec.sampling, spec.engine)
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault((_kind(p), names[i] or None), []).append(i)
        plan = _CallPlan()
        works = []
        for index, ((kind, adapter), members) in enumerate(groups.items()):
            col = _KINDS[kind]
            columns = {"prompt_column": None, "messages_column": None, "prompt_token_ids_column": None,
                       f"{col}_column": col}
            inp = replace(spec.input, adapter_column="adapter", **columns)
            unit = Unit(index, adapter, adapter is None or adapter in spec.adapters, 0, len(members))
            rows = {"id": members, col: [prompts[i] for i in members], "adapter": [adapter] * len(members)}
            works.append(build_unit(unit, rows, None, None, plan, replace(spec, input=inp), self.engine.tokenizer,
                                    functools.partial(self.engine.check_request, job=True)))
        requests = [r for w in works for r in w.requests]
        for res in self.engine.generate(requests):
            unit_index, slot = res.request_id
            works[unit_index].results[slot] = res
        return _outputs(works, len(prompts), spec.sampling.n)


def _kind_or_none(p) -> str | None:
    try:
        return _kind(p)
    except ConfigError:
        return None


@dataclass
class _CallPlan:
    """The bits of a Plan that build_unit reads, for prompts given in a call."""
    override_columns: tuple = ()
    passthrough_columns: tuple = ()
    file_names: tuple = ()


def _outputs(works, count: int, n: int) -> list[RequestOutput]:
    out: list[RequestOutput | None] = [None] * count
    for w in works:
        for slot, res in enumerate(w.results):
            i = w.ids[slot]
            if out[i] is None:
                out[i] = RequestOutput(i, res.adapter, res.prompt_tokens,
                                       error=res.error if res.finish_reason == "error" else None)
            out[i].outputs.append(CompletionOutput(
                slot % n, res.output_text if res.finish_reason != "error" else None, list(res.output_token_ids),
                res.finish_reason, res.stop_reason, res.logprobs, res.top_logprobs))
    return out  # type: ignore[return-value]
