"""Everything a run checks and sets up before loading any weights.

Inputs (files, schemas, ids), model and adapter directories (headers only), tokenizer, output
directory (safe and writable: output_path.py), then the output directory's manifest: a fresh directory gets a plan and a
manifest; a directory holding the same job is resumed; one holding a different job is refused
unless --restart (restart.py: crash-safe, deletes only batchrun's files). The input files are
pinned (pins.py) so the runner notices a change under it.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

from batchrun import __version__
from batchrun.job.store.commit import write_json_atomic
from batchrun.errors import ConfigError, JobChanged, OutputIOError, io_message
from batchrun.job.store.fingerprint import PART_NAMES, combine, job_fingerprint
from batchrun.common import preload
from batchrun.job.inputs.files import check_schemas, find_input_files
from batchrun.job.run.interrupt import start_up_over
from batchrun.job.jobfile.spec import JobSpec, check_max_tokens
from batchrun.engine.config import context_max_model_len
from batchrun.job.store.lock import LockBusy, TaskLock, acquire_waiting
from batchrun.engine.lora.adapters import inspect_adapter
from batchrun.engine.models.checkpoint import inspect_model
from batchrun.engine.models.config import check_context_length
from batchrun.job.store.layout import META, OutputDir
from batchrun.job.store.safe_path import check_output_path, check_unowned_dir
from batchrun.job.inputs.pins import InputPins, Pin, identity
from batchrun.job.plan.resolve_engine import changed_message, resolution_changes, resolve_engine
from batchrun.job.plan.units import Plan, file_name, make_plan
from batchrun.job.storage.uri import is_uri
from batchrun.common.tokenizer import load_tokenizer
from batchrun.job.inputs.token_count import load_counter
from batchrun.job.store.restart import begin_wipe, check_no_active_task, end_wipe, finish_wipe, pending_wipe


@dataclass
class Prepared:
    spec: JobSpec
    out: OutputDir
    plan: Plan
    fingerprint: str
    model_config: object  # batchrun.engine.models ModelConfig
    pins: InputPins  # the input files as this run found them


def check_model_and_adapters(spec: JobSpec) -> object:
    """Read config/headers only (no weights, no torch). Returns the model config."""
    if not os.path.isdir(spec.model):
        raise ConfigError(f"model: {spec.model} is not a directory (expected a Hugging Face model directory)")
    if not os.path.isfile(os.path.join(spec.model, "config.json")):
        raise ConfigError(f"model: {spec.model} has no config.json (expected a Hugging Face model directory)")
    try:
        model_config = inspect_model(spec.model)
    except ConfigError as e:
        raise type(e)(f"model: {e}") from None
    if spec.engine.max_model_len != "auto":
        check_context_length(model_config, spec.engine.max_model_len, spec.model)
    check_max_tokens(spec.sampling, context_max_model_len(spec.engine.max_model_len, model_config),
                     auto=spec.engine.max_model_len == "auto")
    for name, path in spec.adapters.items():
        if not os.path.isdir(path):
            raise ConfigError(f"adapters.{name}: {path} is not a directory (expected a PEFT adapter directory)")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ConfigError(f"adapters.{name}: {path} has no adapter_config.json (expected a PEFT adapter directory)")
        try:
            inspect_adapter(name, path, model_config, spec.engine.max_lora_rank)
        except ConfigError as e:
            raise type(e)(f"adapters.{name}: {e}") from None
    return model_config


def token_counter(spec: JobSpec, use_transformers: bool = False):
    """What counts prompt tokens as the engine will (token_count.py). ``use_transformers``: a run,
    which loads transformers' tokenizer for the engine anyway (common/tokenizer.load_tokenizer loads
    it once per process); `plan` needs no transformers for plain-text prompts. Checks that a chat
    template exists if the job needs one."""
    from batchrun.job.inputs.prompts import uses_chat_template
    counter = load_counter(spec.model, uses_chat_template(spec.input), use_transformers)
    if spec.input.messages_column and not getattr(counter.hf, "chat_template", None):
        raise ConfigError(f"input.messages_column: the tokenizer in {spec.model} has no chat template; "
                          "use prompt_column with preformatted text instead")
    if spec.input.system_prompt is not None and not getattr(counter.hf, "chat_template", None):
        raise ConfigError(f"input.system_prompt: the tokenizer in {spec.model} has no chat template to render "
                          "it with; remove system_prompt, or write it into the prompts")
    return counter


def check_output_writable(out: OutputDir) -> None:
    try:
        os.makedirs(out.meta, exist_ok=True)
        probe = os.path.join(out.meta, f".probe.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"output.path: cannot write to {out.path}: {e.strerror or e}") from None


def check_structured(spec: JobSpec, model_config) -> None:
    """response_format: xgrammar is installed, and the job-level format compiles (imports torch:
    only jobs that ask for structured output pay for it here)."""
    preload.wait()  # grammar.py imports torch: not while the preload thread does
    from batchrun.engine.grammar import _xgrammar, check_response_format
    _xgrammar()
    if spec.sampling.response_format is not None:
        tok = load_tokenizer(spec.model)
        if tok is None:
            raise ConfigError(f"sampling.response_format: {spec.model} has no tokenizer to build the grammar from")
        eos = set(model_config.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
        check_response_format(spec.sampling.response_format, tok, model_config.vocab_size, eos)


def check_tokenizer(spec: JobSpec, for_run: bool = False) -> None:
    """A broken tokenizer or a missing chat template fails before anything is written or loaded."""
    if not spec.input.prompt_token_ids_column:  # token-id prompts need no tokenizer
        token_counter(spec, for_run)


def validate(spec: JobSpec, for_run: bool = False) -> tuple[list[str], str, object, object]:
    """All pre-load checks; returns (files, root, input schema, model config). ``for_run``: all
    but the tokenizer's, which prepare makes after the inputs are digested (the engine's
    transformers tokenizer, loaded once: on the preload thread, overlapping the digests)."""
    files, root = find_input_files(spec.input)
    schema = check_schemas(files, spec.input, spec.sampling.overrides)
    model_config = check_model_and_adapters(spec)
    if not for_run:
        check_tokenizer(spec)
    if spec.sampling.response_format is not None or "response_format" in schema.override_columns:
        check_structured(spec, model_config)
    check_output_path(spec, files)
    return files, root, schema, model_config


def prepare(spec: JobSpec, restart: bool = False, log=None, restart_token: str | None = None) -> Prepared:
    """Validate, fingerprint, and create/resume/refuse the output directory's job state.

    ``restart_token``: restart only if the manifest was not made by a restart with this token
    (the sbatch script of `batchrun slurm --restart` carries one, so resubmitting or requeueing it
    resumes instead of wiping again). Without one, SLURM_ARRAY_JOB_ID plays that part, so the
    tasks of one array restart the directory once.

    Runs under the output dir's manifest lock so concurrent array tasks agree on one plan.
    """
    files, root, schema, model_config = validate(spec, for_run=True)
    out = OutputDir(spec.output.path, spec.output.storage_options)
    names = [file_name(f, root) for f in files]
    pins = _pins(out, files, spec.input.storage_options)  # each input read at most once: its digest serves the fingerprint too
    max_model_len = context_max_model_len(spec.engine.max_model_len, model_config)
    parts = job_fingerprint(spec, files, names, list(schema.override_columns), digests=[p.digest for p in pins],
                            max_model_len=max_model_len)
    fp = combine(parts)
    check_tokenizer(spec, for_run=True)  # waits for the preload thread's imports and tokenizer
    preload.wait()  # (token-id prompts load no tokenizer) the preload thread is idle from here on,
    resolved = resolve_engine(spec, model_config)  # (may import torch: only after the wait)
    start_up_over()  # and the first write follows: a signal now raises Interrupted (interrupt.py)
    token = restart_token or os.environ.get("SLURM_ARRAY_JOB_ID")  # restart once per token
    restart = restart or bool(restart_token)
    if out.is_object:  # the same steps on an object store: keys, leases, conditional writes
        from batchrun.job.store.claims import lease_from_env
        from batchrun.job.store.objects.job_state import job_state
        file_ids = [[p.size, p.mtime_ns, p.digest] for p in pins]
        plan = job_state(spec, out, out.store, restart, parts, fp, token, files, root, schema, file_ids,
                         log or (lambda m: None), resolved, max_model_len, lease_from_env())
        if plan.files != files:
            plan.files = list(files)
        plan.file_ids = file_ids
        return Prepared(spec, out, plan, fp, model_config, InputPins(plan.files, pins, spec.input.storage_options))
    if not os.path.lexists(out.manifest) and not pending_wipe(out):
        check_unowned_dir(out)  # not ours: refuse before creating anything there, --restart or not
    check_output_writable(out)

    meta_lock = TaskLock(os.path.join(out.locks, "manifest.lock"), "planning")
    _acquire_blocking(meta_lock, out, log or (lambda m: None))
    try:
        file_ids = [[p.size, p.mtime_ns, p.digest] for p in pins]
        plan = _job_state(spec, out, restart, parts, fp, token, files, root, schema, file_ids,
                          log or (lambda m: None), resolved, max_model_len)
    except OSError as e:
        raise OutputIOError(io_message(e, "output.path")) from None
    finally:
        meta_lock.release()
    if plan.files != files:  # same content (the fingerprint says so), found at new paths: read those
        plan.files = list(files)
    plan.file_ids = file_ids
    return Prepared(spec, out, plan, fp, model_config, InputPins(plan.files, pins, spec.input.storage_options))


def _pins(out: OutputDir, files: list[str], options=None) -> list[Pin]:
    """Each input's identity. A file the stored plan lists at the same path with the same size
    and mtime keeps the plan's digest (the rule pins.py applies during a run), so the workers
    that join a planned output directory stat the inputs instead of reading them again."""
    known = {}
    try:
        with open(os.path.join(out.plan_dir, "plan.json")) as f:
            meta = json.load(f)
        known = {path: ids for path, ids in zip(meta["files"], meta.get("file_ids") or [])}
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no stored plan (yet), or a damaged one: digest everything
    pins = []
    for path in files:
        if is_uri(path):  # an object: one HEAD gives size and ETag, nothing to save
            pins.append(identity(path, options))
            continue
        ids = known.get(path)
        if isinstance(ids, list) and len(ids) == 3:
            st = os.stat(path)
            if [st.st_size, st.st_mtime_ns] == ids[:2]:
                pins.append(Pin(st.st_size, st.st_mtime_ns, ids[2]))
                continue
        pins.append(identity(path))
    return pins


def _job_state(spec, out, restart, parts, fp, token, files, root, schema, file_ids, log, resolved,
               max_model_len: int) -> Plan:
    """Under the manifest lock: finish an interrupted restart, then resume, refuse, or restart."""
    wiped = pending_wipe(out)
    if wiped:
        log(f"finishing an interrupted --restart of {out.path} first")
        finish_wipe(out)
    try:
        manifest = _read_manifest(out)
    except ConfigError:
        if not restart:
            raise
        manifest = None  # damaged: --restart deletes what the commit markers name
    if manifest is not None and manifest.get("fingerprint") != fp and not restart:
        changed = [PART_NAMES[k] for k, v in parts.items() if manifest.get("parts", {}).get(k) != v]
        raise JobChanged(
            f"output.path: {out.path} holds results of a different job (changed: "
            f"{'; '.join(changed) or 'batchrun version'}). "
            + max_model_len_hint(manifest, spec, max_model_len)
            + "Rerun with --restart to discard them, or choose another output.path.")
    if restart and not (manifest is not None and token and manifest.get("restart_token") == token):
        begin_wipe(out, manifest)
        manifest, wiped = None, True
    if manifest is not None:
        _check_resolved(out, manifest, resolved, log)
    plan = None
    if manifest is None:
        if not wiped:  # a directory just restarted is this job's, whatever else the user keeps there
            check_unowned_dir(out)
        if os.path.isdir(out.commits):  # markers without the manifest that made them prove nothing
            check_no_active_task(out)
            shutil.rmtree(out.commits)
    else:
        try:
            plan = Plan.load(out.plan_dir)
        except (OSError, ValueError):
            plan = None  # manifest without a complete plan: a crash while planning
    if plan is None:
        plan = make_plan(spec, files, root, schema)
        plan.fingerprint = fp
        plan.file_ids = file_ids
        if os.path.isdir(out.plan_dir):
            shutil.rmtree(out.plan_dir)
        plan.save(out.plan_dir)
        write_json_atomic(out.manifest, {
            "fingerprint": fp, "parts": parts, "restart_token": token,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "batchrun_version": __version__,
            "engine_resolved": resolved,
            "job_file": spec.job_file, "job": spec.to_dict(),
            "total_rows": plan.total_rows, "total_units": len(plan.units),
            "part_files": "part-NNNNNN.parquet for units 0 .. total_units-1 (only these are ever deleted)",
        })
    if wiped:
        end_wipe(out)
    return plan


def max_model_len_hint(manifest: dict, spec: JobSpec, max_model_len: int) -> str:
    """When the output was started with another engine.max_model_len than this job resolves to,
    a sentence naming both and the value that resumes it ("" otherwise). The case it is for: an
    output started with the old default 2048, rerun by a job file that leaves max_model_len out
    (auto now) on a model whose context is not 2048: rows between the two limits would be error
    rows in one part and answers in another, so the run is refused rather than mixed."""
    try:
        old = manifest["job"]["engine"]["max_model_len"]
    except (KeyError, TypeError):
        return ""
    if not isinstance(old, int) or isinstance(old, bool) or old == max_model_len:
        return ""  # old "auto": a changed config.json, which the model part already names
    now = (f"auto, which is the model's context {max_model_len}" if spec.engine.max_model_len == "auto"
           else str(max_model_len))
    default = " (2048 was the default before auto)" if old == 2048 else ""
    return (f"It was started with engine.max_model_len {old}{default}; this job's is {now}. Set "
            f"engine.max_model_len: {old} to resume it. ")


def _check_resolved(out: OutputDir, manifest: dict, resolved: dict, log) -> None:
    """Refuse to resume an output whose engine settings resolved differently when it was started
    (resolve_engine.py); record them in a manifest that lacks some (an older batchrun's)."""
    started = manifest.get("engine_resolved")
    started = started if isinstance(started, dict) else {}
    changes = resolution_changes(started, resolved)
    if changes:
        raise JobChanged(changed_message(out.path, changes))
    missing = [k for k in resolved if k not in started]
    if not missing:
        return
    if not started:
        log(f"note: {out.path} was started by a batchrun that did not record what engine.device/dtype "
            f"resolved to; recording this node's ({', '.join(f'{k} {resolved[k]}' for k in missing)}). "
            "If its units so far ran elsewhere with other numerics, rerun with --restart")
    write_json_atomic(out.manifest, {**manifest, "engine_resolved": {**started, **resolved}})


# How long a worker waits for another to finish planning the same output directory: planning
# 100M rows takes minutes; a holder that died releases the lock at once (lockf).
PLAN_WAIT_S = 600.0


def _acquire_blocking(lock: TaskLock, out: OutputDir, log, timeout: float | None = None) -> None:
    """Wait (bounded) for the worker that is planning this output directory; it publishes the
    plan and the manifest before it lets go, so the waiter then reads them instead of planning."""
    timeout = PLAN_WAIT_S if timeout is None else timeout
    try:
        acquire_waiting(lock, timeout, lambda e: log(
            f"another worker is planning {out.path}; waiting for its plan (up to {timeout:g} s)"))
    except LockBusy as e:
        raise LockBusy(f"output.path: waited {timeout:g} s for another worker to finish planning "
                       f"{out.path} and it has not ({e}). If that worker is hung, stop it; "
                       "then rerun (a finished plan is reused)") from None


def _read_manifest(out: OutputDir) -> dict | None:
    try:
        with open(out.manifest) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"output.path: {out.manifest} is damaged ({e}); rerun with --restart "
                          "to start over") from None
    if not isinstance(manifest, dict) or "fingerprint" not in manifest:
        raise ConfigError(f"output.path: {out.manifest} is damaged (not a batchrun manifest); rerun with "
                          "--restart to start over")
    return manifest


__all__ = ["JobChanged", "Prepared", "prepare", "validate", "token_counter", "check_output_writable", "META"]
