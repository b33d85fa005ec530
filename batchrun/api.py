"""The Python API: ``batchrun.run(job)`` and ``batchrun.LLM(model)`` with vLLM's ``generate`` / ``chat``.

Both are thin over the CLI's code: ``run`` is ``batchrun run`` in-process (same validation,
plan, resume, commits); ``LLM`` validates its settings as job.yaml fields (``parse_job``), loads
the engine the runner loads (``runner.load_engine``), and turns prompts into requests with the
runner's row builder (``rows.build_unit``), so a prompt, a sampling setting or a bad value gives
the same tokens or the same error as in a job. A prompt given the id of a job row (``request_ids``)
with the job's sampling settings gets that row's tokens.

    import batchrun
    llm = batchrun.LLM("demo/model", adapters={"upper": "demo/adapters/upper"}, device="cpu")
    sp = batchrun.SamplingParams(max_tokens=16, n=2, temperature=0.8)
    out = llm.generate(["hello world"], sp, lora_request="upper")
    out[0].outputs[1].text
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from batchrun.api_adapters import LoRARequest, adapter_names
from batchrun.api_outputs import CompletionOutput, Logprob, RequestOutput, completion
from batchrun.api_prompts import KINDS, CallPrompt, chat_prompts, generate_prompts
from batchrun.api_sampling import SamplingParams, sampling_key, sampling_list
from batchrun.errors import ConfigError
from batchrun.job.jobfile.spec import JobSpec, SamplingSpec, check_max_tokens, load_job, parse_job, parse_sampling

__all__ = ["LLM", "SamplingParams", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob", "run"]

logger = logging.getLogger("batchrun")


def run(job: str | os.PathLike | dict, task_id: int = 0, num_tasks: int = 1, restart: bool = False,
        progress: bool | str = False, log=None):
    """Run a job file (path) or a job mapping (relative paths resolve against the current
    directory) like ``batchrun run``; returns the task's TaskStats. Raises ConfigError etc."""
    from batchrun.job.run.runner import run_job
    spec = parse_job(job, base_dir=os.getcwd()) if isinstance(job, dict) else load_job(job)
    return run_job(spec, task_id=task_id, num_tasks=num_tasks, restart=restart, progress=progress,
                   log=log or (lambda m: None))


class LLM:
    """An in-process engine. ``engine`` takes job.yaml's engine fields (device, dtype,
    max_model_len, max_num_seqs, ...); ``input`` its prompt options (system_prompt,
    chat_template_kwargs, add_special_tokens); ``adapters`` {name: PEFT directory}."""

    def __init__(self, model: str | os.PathLike, adapters: dict[str, str] | None = None,
                 input: dict | None = None, **engine):
        # Sampling comes with each call (and is checked against max_model_len there): the
        # max_tokens given here only keeps parse_job's check from refusing a short max_model_len.
        raw = {"model": str(model), "adapters": dict(adapters or {}) or None,
               "input": {"path": "-", "id_column": "id", **(input or {}),
                         **({"adapter_column": "adapter"} if adapters else {})},
               "output": {"path": "-"}, "sampling": {"max_tokens": 1}, "engine": engine}
        self.spec: JobSpec = parse_job(raw, base_dir=os.getcwd())
        from batchrun.job.plan.prepare import check_model_and_adapters
        from batchrun.job.run.runner import load_engine
        check_model_and_adapters(self.spec)  # the pre-weights checks `batchrun run` makes
        self.engine = load_engine(self.spec)
        self._told: set = set()  # generation_config.json defaults already logged

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool | Callable = True,
                 lora_request: Any = None, *, adapters: Any = None,
                 request_ids: Sequence | None = None) -> list[RequestOutput]:
        """Prompts -> one RequestOutput each, in order.

        A prompt is a string, a list of token ids, a list of {role, content} messages, or a dict
        {"prompt": str} / {"prompt_token_ids": [...]} with an optional "id". ``sampling_params``:
        a SamplingParams (or a dict of job.yaml sampling fields) for all prompts, or a list with
        one per prompt. ``lora_request`` / ``adapters``: one adapter for all prompts or one per
        prompt (None = base model). ``request_ids``: the job row id of each prompt; sampling is
        seeded from it exactly as ``batchrun run`` seeds that row (default: the position).
        ``use_tqdm``: a progress bar on stderr (False: none; a callable: a tqdm-like factory).
        """
        items = generate_prompts(prompts, request_ids)
        return self._run(items, sampling_params, use_tqdm, lora_request, adapters, self.spec.input)

    def chat(self, messages: Any, sampling_params: Any = None, use_tqdm: bool | Callable = True,
             lora_request: Any = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: Any = None,
             chat_template_kwargs: dict | None = None, *, adapters: Any = None,
             request_ids: Sequence | None = None) -> list[RequestOutput]:
        """One conversation (a list of {role, content} messages) or a list of them -> one
        RequestOutput each. The model's chat template renders each one as the job renders a
        messages_column row (with the LLM's system_prompt, chat_template_kwargs and
        add_special_tokens; ``chat_template_kwargs`` here adds to / overrides the LLM's).
        Other arguments as ``generate``."""
        for name, value, ok, why in (
                ("chat_template", chat_template, chat_template is None,
                 "batchrun uses the model's own template, as a job does; edit tokenizer_config.json or "
                 "chat_template.jinja in a copy of the model"),
                ("chat_template_content_format", chat_template_content_format,
                 chat_template_content_format in ("auto", "string"), "message content is always a string"),
                ("add_generation_prompt", add_generation_prompt, add_generation_prompt is True,
                 "jobs always add the generation prompt"),
                ("continue_final_message", continue_final_message, continue_final_message is False,
                 "jobs always start a new assistant message"),
                ("tools", tools, not tools, "tool definitions are not passed to the template")):
            if not ok:
                raise ConfigError(f"chat: {name}={value!r} is not supported ({why})")
        inp = self.spec.input
        if chat_template_kwargs:
            if not isinstance(chat_template_kwargs, dict):
                raise ConfigError(f"chat: chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
            inp = replace(inp, chat_template_kwargs={**(inp.chat_template_kwargs or {}), **chat_template_kwargs})
        items = chat_prompts(messages, request_ids)
        return self._run(items, sampling_params, use_tqdm, lora_request, adapters, inp)

    # ---- one call --------------------------------------------------------------------------

    def _run(self, items: list[CallPrompt], sampling_params, use_tqdm, lora_request, adapters,
             inp) -> list[RequestOutput]:
        self._check_tokenizer(items, inp)
        names = adapter_names(adapters, lora_request, len(items), self.spec.adapters)
        works, members_of = self._works(items, names, self._samplings(sampling_params, len(items)), inp)
        requests = [r for w in works for r in w.requests]
        with _Progress(use_tqdm, works, len(items)) as bar:
            for res in self.engine.generate(requests, on_result=bar.done):
                unit_index, slot = res.request_id
                works[unit_index].results[slot] = res
        return self._outputs(items, works, members_of, {r.request_id: r.prompt_token_ids for r in requests}, inp)

    def _works(self, items: list[CallPrompt], names: list, samplings: list, inp) -> tuple[list, list]:
        """The call's prompts as the runner's units: one per (prompt kind, adapter, sampling), each
        built by rows.build_unit as a job builds a unit's rows. Returns (works, call positions per work)."""
        from batchrun.job.plan.units import Unit
        from batchrun.job.inputs.rows import build_unit
        groups: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault((item.kind, names[i], samplings[i][0]), []).append(i)
        check = functools.partial(self.engine.check_request, job=True)
        works, members_of = [], []
        for index, ((kind, adapter, _), members) in enumerate(groups.items()):
            col = KINDS[kind]
            columns = {"prompt_column": None, "messages_column": None, "prompt_token_ids_column": None,
                       f"{col}_column": col}
            spec = replace(self.spec, sampling=samplings[members[0]][1],
                           input=replace(inp, adapter_column="adapter", **columns))
            unit = Unit(index, adapter, adapter is None or adapter in spec.adapters, 0, len(members))
            rows = {"id": [items[i].id for i in members], col: [items[i].value for i in members],
                    "adapter": [adapter] * len(members)}
            works.append(build_unit(unit, rows, None, None, _CallPlan(), spec, self.engine.tokenizer, check))
            members_of.append(members)
        return works, members_of

    def _outputs(self, items: list[CallPrompt], works: list, members_of: list, prompt_ids: dict,
                 inp) -> list[RequestOutput]:
        decode = self._decoder()
        out: list[RequestOutput | None] = [None] * len(items)
        for w, members in zip(works, members_of):
            for slot, res in enumerate(w.results):  # slot = row * n + sample
                i = members[slot // w.n]
                if out[i] is None:
                    item = items[i]
                    ids = prompt_ids.get((w.unit.index, slot - slot % w.n))
                    out[i] = RequestOutput(item.id, self._prompt_text(item, inp), None if ids is None else list(ids),
                                           index=i, adapter=res.adapter, prompt_tokens=res.prompt_tokens,
                                           error=res.error if res.finish_reason == "error" else None)
                out[i].outputs.append(completion(res, slot % w.n, decode))
        return out  # type: ignore[return-value]

    def _decoder(self):
        """token id -> its text (None without a tokenizer), cached for the call."""
        tok = self.engine.tokenizer
        return functools.lru_cache(maxsize=None)(lambda t: None if tok is None else tok.decode([t]))

    def _check_tokenizer(self, items: list[CallPrompt], inp) -> None:
        """Text needs a tokenizer and conversations a chat template (as a job's prompt_column
        and messages_column do): refuse the call rather than fail every prompt."""
        tok = self.engine.tokenizer
        for i, item in enumerate(items):
            if item.kind != "ids" and tok is None:
                raise ConfigError(f"prompts[{i}]: {self.spec.model} has no tokenizer; give prompts as token ids")
            chat = item.kind == "messages" or (item.kind == "text" and inp.system_prompt is not None)
            if chat and not getattr(tok, "chat_template", None):
                raise ConfigError(f"prompts[{i}]: the tokenizer in {self.spec.model} has no chat template to render "
                                  "a conversation (or input.system_prompt) with; give preformatted text to generate")

    def _samplings(self, sampling_params, count: int) -> list[tuple[str, SamplingSpec]]:
        """(key, parsed sampling) per prompt; equal settings are parsed (and logged) once."""
        parsed: dict[str, SamplingSpec] = {}
        out = []
        for label, raw in sampling_list(sampling_params, count):
            key = sampling_key(raw)
            if key not in parsed:
                try:
                    smp = parse_sampling(raw, self.spec.model)
                    check_max_tokens(smp, self.engine.config.max_model_len,  # as the engine resolved it
                                     auto=self.spec.engine.max_model_len == "auto")
                except ConfigError as e:
                    raise ConfigError(f"{label}: {e}") from None
                self._tell_generation_config(smp)
                parsed[key] = smp
            out.append((key, parsed[key]))
        return out

    def _tell_generation_config(self, smp: SamplingSpec) -> None:
        """Log (once per LLM and set of values) the sampling defaults generation_config.json set."""
        if not smp.from_generation_config:
            return
        values = tuple((k, getattr(smp, k)) for k in smp.from_generation_config)
        if values in self._told:
            return
        self._told.add(values)
        shown = ", ".join(f"{k}={v!r}" for k, v in values)
        logger.warning("batchrun.LLM: the model's generation_config.json (%s) sets %s for sampling fields "
                       "this call leaves unset, as `batchrun run` does for job.yaml; set them in "
                       "SamplingParams to override", os.path.join(self.spec.model, "generation_config.json"), shown)

    def _prompt_text(self, item: CallPrompt, inp) -> str | None:
        if item.kind == "text":
            return item.value
        if item.kind == "ids":
            return None
        from batchrun.job.inputs import prompts
        tok = self.engine.tokenizer
        if tok is None:
            return None
        try:
            return tok.apply_chat_template(prompts.chat_messages(inp, messages=item.value), add_generation_prompt=True,
                                           tokenize=False, **dict(inp.chat_template_kwargs or {}))
        except Exception:  # the template failed: the output carries build_unit's error for it
            return None


@dataclass
class _CallPlan:
    """The bits of a Plan that build_unit reads, for prompts given in a call."""
    override_columns: tuple = ()
    passthrough_columns: tuple = ()
    file_names: tuple = ()


class _Progress:
    """A tqdm bar over the call's prompts: one step when a prompt's last output is done."""

    def __init__(self, use_tqdm, works, count: int):
        self.bar = None
        self.left: dict[tuple, int] = {}
        self.works = works
        if not use_tqdm or not count:
            return
        for w in works:
            for slot, res in enumerate(w.results):
                if res is None:
                    key = (w.unit.index, slot // w.n)
                    self.left[key] = self.left.get(key, 0) + 1
        if callable(use_tqdm) and not isinstance(use_tqdm, bool):
            factory = use_tqdm
        else:
            from tqdm import tqdm as factory
        self.bar = factory(total=count, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        self.bar.update(count - len(self.left))  # prompts that are error outputs already

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()

    def done(self, res) -> None:
        if self.bar is None:
            return
        unit_index, slot = res.request_id
        key = (unit_index, slot // self.works[unit_index].n)
        self.left[key] -= 1
        if not self.left[key]:
            self.bar.update(1)
