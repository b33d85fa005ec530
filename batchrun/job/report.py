"""What `plan`, `status` and `show` print. Reads only metadata, inputs and tokenizers: no weights.

Size (~360 lines): three reports over the same plan and output-directory readers; the plan's
token counting lives here because only the report needs per-shard totals (token_count.py does
the tokenizing, token_estimate.py the sampled estimate)."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchrun.job.inputs.arrow_types import plain_table
from batchrun.job.storage.uri import is_uri
from batchrun.errors import ConfigError, OutputIOError
from batchrun.job.storage.options import StorageOptions
from batchrun.job.storage.registry import storage_for
from batchrun.job.run.error_rate import error_rate_problem
from batchrun.job.exit_codes import ExitCode
from batchrun.job.inputs.files import INVALID, InvalidText, RowReader, column_values
from batchrun.job.jobfile.spec import JobSpec, sampling_summary
from batchrun.job.store.layout import OutputDir
from batchrun.job.plan.units import Plan, assign_tasks, engine_groups, group_rows, make_plan
from batchrun.job.plan.formats import format_checker
from batchrun.job.plan.prepare import token_counter, validate
from batchrun.job.inputs.prompts import chat_messages
from batchrun.job.inputs.rows import _sampling
from batchrun.job.run.progress_files import HEADER, worker_rows
from batchrun.job.inputs.token_estimate import Estimate
from batchrun.engine.request_check import too_long
from batchrun.engine.config import context_max_model_len
from batchrun.engine.models.quant import with_quantization


def weights_line(model_config, quantization: str | None) -> str:
    """What the linear layers run in: the checkpoint's FP8 scheme, FP8 made at load time, or the
    model dtype (plan's engine line)."""
    scheme = with_quantization(model_config, quantization).quant
    return "the model dtype" if scheme is None else scheme.name


def _shard_name(adapter: str | None, known: bool) -> str:
    return "base" if adapter is None else adapter if known else f"{adapter} (unknown)"


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join(fmt(r) for r in cells)


def plan_report(spec: JobSpec, num_tasks: int, count_tokens: bool = True, estimate_tokens: bool = False) -> str:
    """``estimate_tokens``: token totals of plain-text prompts from a sample (token_estimate.py),
    error rows still exact."""
    files, root, schema, model_config = validate(spec)
    check_device(spec.engine.device)  # what the run would refuse, plan refuses too
    out = OutputDir(spec.output.path, spec.output.storage_options)
    out.backend.refuse_unowned()  # what run would refuse, plan refuses too
    plan = make_plan(spec, files, root, schema)
    lines = [f"job:      {spec.job_file}",
             f"model:    {spec.model}",
             f"adapters: {', '.join(f'{k} ({v})' for k, v in spec.adapters.items()) or 'none'}",
             f"input:    {len(files)} file(s), {plan.total_rows} rows",
             f"output:   {spec.output.path}"]
    lines += sampling_summary(spec.sampling, plan.override_columns)
    if spec.sampling.response_format is not None:
        lines.append(f"          response_format={spec.sampling.response_format}")
    e = spec.engine
    seqs = ("auto (sized from the KV cache when the engine starts)" if e.max_num_seqs == "auto"
            else e.max_num_seqs)
    max_model_len = context_max_model_len(e.max_model_len, model_config)
    shown_len = (f"auto ({max_model_len}: the model's context; lowered when the engine starts if its "
                 "KV cache holds less for one sequence)" if e.max_model_len == "auto" else max_model_len)
    lines += [f"engine:   device={e.device}, dtype={e.dtype}, max_num_seqs={seqs}, max_model_len={shown_len}, "
              f"{loras_line(spec)}",
              f"          weights: {weights_line(model_config, e.quantization)}; KV cache: "
              f"{'fp8 (e4m3)' if e.kv_cache_dtype == 'fp8' else 'the model dtype'}", ""]
    tokens, bad, note = (_prompt_tokens(spec, plan, estimate_tokens, model_config, max_model_len) if count_tokens
                         else ({}, {}, None))
    shards = plan.shards()
    n = spec.sampling.n  # the run writes n output rows per input row, an error row per sample too
    rows = []
    predicted = 0  # error output rows plan can foresee (a lower bound: the engine may refuse more)
    for code, sh in enumerate(shards):
        key = (sh.adapter, sh.known)
        bad_rows = sh.rows if not sh.known else bad.get(key, None if not count_tokens else 0)
        predicted += (bad_rows or 0) * n
        rows.append([_shard_name(*key), sh.rows, tokens.get(key, "-"), sh.units]
                    + ([sh.rows * n] if n > 1 else []) + ["-" if bad_rows is None else bad_rows * n])
    lines.append(_table(["shard", "rows", "prompt tokens", "units"] + (["output rows"] if n > 1 else [])
                        + ["error rows"], rows))
    if n > 1:
        lines.append(f"(sampling.n = {n}: each input row gives {n} output rows, one per sample_index; "
                     f"a bad input row gives {n} error rows)")
    if note:
        lines.append(note)
    if predicted:
        lines.append(_error_rate_note(predicted, plan.total_rows * n, spec.max_error_rate))
    lines += ["", "engine batches (adapters whose rows share the engine's steps, "
              f"up to {lora_slots(spec)} at once):"]
    for g in _batches(plan, spec):
        lines.append("  " + " + ".join(dict.fromkeys(_shard_name(u.adapter, u.known) for u in g))
                     + f": {sum(u.rows for u in g)} rows")
    lines += ["", f"work units: {len(plan.units)} of up to {spec.input.rows_per_unit} rows"]
    tasks = assign_tasks(plan, num_tasks)
    trows = []
    for t in range(num_tasks):
        us = [u for u, tt in zip(plan.units, tasks) if tt == t]
        span = f"{us[0].index}-{us[-1].index}" if us else "-"
        names = ", ".join(dict.fromkeys(_shard_name(u.adapter, u.known) for u in us)) or "-"
        trows.append([f"task {t}", len(us), span, sum(u.rows for u in us), names])
    lines += ["", _table(["task", "units", "unit ids", "rows", "shards"], trows)]
    return "\n".join(lines)


def _error_rate_note(predicted: int, total: int, limit: float | None) -> str:
    """plan's line on the predicted error rows, and whether the run will exit 10 for them."""
    text = f"predicted error rows: {predicted} of {total} output rows ({100 * predicted / max(total, 1):.2f} %)"
    fails = error_rate_problem(predicted, total, limit) is not None
    code = int(ExitCode.ERROR_RATE)
    if limit is None:
        return (f"{text}: every row, so the run will exit {code} (max_error_rate: 1 accepts it)" if fails else
                f"{text}; max_error_rate is unset: the run exits {code} only if every row fails")
    return (f"{text}: more than max_error_rate {limit:g}, so the run will exit {code}" if fails else
            f"{text}; within max_error_rate {limit:g}")


def lora_slots(spec: JobSpec) -> int:
    """The LoRA slots the run's engine will have: engine.max_loras, but never more than the
    configured adapters (lora/manager.py sizes them so)."""
    return max(1, min(spec.engine.max_loras, len(spec.adapters)))


def loras_line(spec: JobSpec) -> str:
    """plan's max_loras: what the run will use, and where it came from when that differs."""
    if not spec.adapters:
        return "max_loras=0 (no adapters: LoRA is off)"
    slots = lora_slots(spec)
    if slots == spec.engine.max_loras:
        return f"max_loras={slots}"
    return f"max_loras={slots} (engine.max_loras {spec.engine.max_loras}, {len(spec.adapters)} adapter(s) configured)"


def check_device(device: str) -> None:
    """engine.device: cuda on a machine without a visible GPU fails plan as it fails the run
    (engine.resolve_device; imports torch only for device: cuda)."""
    if device != "cuda":
        return
    import torch
    if not torch.cuda.is_available():
        raise ConfigError("engine.device: 'cuda' asked for but no CUDA GPU is visible; "
                          "use device: auto or cpu")


def _batches(plan: Plan, spec: JobSpec) -> list[list]:
    """The runner's engine groups over the whole plan, consecutive ones of equal adapters merged
    (a long shard is cut into several calls only to bound memory)."""
    merged: list[list] = []
    for g in engine_groups(plan.units, group_rows(spec.engine.max_num_seqs), spec.engine.max_loras):
        names = {(u.adapter, u.known) for u in g}
        if merged and names == {(u.adapter, u.known) for u in merged[-1]}:
            merged[-1] = merged[-1] + g
        else:
            merged.append(g)
    return merged


def _prompt_tokens(spec: JobSpec, plan: Plan, estimate: bool = False,
                   model_config=None, max_model_len: int | None = None) -> tuple[dict, dict, str | None]:
    """Prompt tokens and predictable error rows per shard (tokenizer only, file by file, in
    column batches: token_count.py's counts, numpy for the checks, no Python object kept per row),
    and a note for the table when the totals are estimated. ``model_config``: validate()'s, for
    compiling per-row response_format values (plan_formats.py). ``max_model_len``: the limit as
    config.json resolves it (auto: the model's context); default: the job's integer."""
    inp = spec.input
    max_model_len = spec.engine.max_model_len if max_model_len is None else max_model_len
    tok = None if inp.prompt_token_ids_column else token_counter(spec)
    shard_keys = list(dict.fromkeys((u.adapter, u.known) for u in plan.units))
    code_of = {k: i for i, k in enumerate(shard_keys)}
    # shard code of every row, per file (the plan stores rows in unit order)
    per_file = [np.zeros(n, dtype=np.int32) for n in plan.file_rows]
    for u in plan.units:
        rf, ri = plan.unit_rows(u)
        for fi in np.unique(rf):
            per_file[fi][ri[rf == fi]] = code_of[(u.adapter, u.known)]
    tokens = np.zeros(len(shard_keys), dtype=np.int64)
    bad = np.zeros(len(shard_keys), dtype=np.int64)
    col = inp.prompt_column or inp.messages_column or inp.prompt_token_ids_column
    extra = [c for c in plan.override_columns if c != col]
    plain = (tok is not None and tok.backend is not None and not inp.messages_column
             and inp.system_prompt is None)
    est = (Estimate(tok, inp.add_special_tokens is not False, plan.total_rows, len(shard_keys))
           if estimate and plain else None)
    compiles = (format_checker(spec, model_config)
                if "response_format" in extra and model_config is not None else None)
    first_row = 0
    for fi, path in enumerate(plan.files):
        start = 0
        for batch in storage_for(path, inp.storage_options).parquet_file(path).iter_batches(batch_size=32768, columns=[col] + extra):
            batch = plain_table(batch)  # view types: arrow_types.py
            n = batch.num_rows
            codes = per_file[fi][start:start + n]
            start += n
            mt = np.full(n, spec.sampling.max_tokens, dtype=np.float64)
            if extra:  # a bad override is an error row at run time too (rows._sampling decides both)
                overrides = {c: column_values(batch.column(c)) for c in extra}
                for i in range(n):
                    try:
                        sp = _sampling(spec, overrides, i, None, extra)
                    except (ValueError, TypeError):
                        mt[i] = np.inf
                        continue
                    mt[i] = sp.max_tokens
                    fmt = sp.response_format
                    if compiles is not None and fmt is not None and fmt != spec.sampling.response_format \
                            and not compiles(fmt):
                        mt[i] = np.inf  # the engine refuses a format that does not compile
            if est is not None:
                is_bad = _estimated_batch(est, tok, inp, batch.column(col), codes, mt,
                                          max_model_len, first_row)
                bad += np.bincount(codes, weights=is_bad, minlength=len(shard_keys)).astype(np.int64)
                first_row += n
                continue
            lens = row_lengths(tok, inp, batch.column(col))
            # lens -1: refused before tokenizing; 0: "empty prompt" (request_check's first test)
            is_bad = (lens <= 0) | too_long(lens, mt, max_model_len)
            bad += np.bincount(codes, weights=is_bad, minlength=len(shard_keys)).astype(np.int64)
            tokens += np.bincount(codes, weights=np.maximum(lens, 0), minlength=len(shard_keys)).astype(np.int64)
    bad_of = {k: int(bad[i]) for k, i in code_of.items()}
    if est is not None:
        totals = est.totals()
        if est.estimated:
            return {k: f"~{int(totals[i])}" for k, i in code_of.items()}, bad_of, est.note()
        return {k: int(totals[i]) for k, i in code_of.items()}, bad_of, est.note()
    note = ("(prompt tokens exact: --estimate-tokens covers plain-text prompts without system_prompt)"
            if estimate and not plain and tok is not None else None)
    return {k: int(tokens[i]) for k, i in code_of.items()}, bad_of, note


def _estimated_batch(est, tok, inp, texts, codes, mt, max_model_len: int, first_row: int) -> np.ndarray:
    """One column batch in --estimate-tokens mode: tokenizes only the rows est.must_count names,
    adds the batch to est and returns its error-row mask (exact)."""
    texts = _plain_strings(texts)
    keep = prompt_lengths(tok, texts, lengths=False)
    nbytes = (np.zeros(len(texts), dtype=np.int64) if pa.types.is_null(texts.type) else
              np.asarray(pc.binary_length(texts).fill_null(0), dtype=np.int64))
    counted = keep & est.must_count(nbytes, first_row, max_model_len - mt)
    lens = np.full(len(texts), -1, dtype=np.int64)
    if counted.any():
        lens[counted] = prompt_lengths(tok, texts.filter(pa.array(counted)),
                                       add_special_tokens=inp.add_special_tokens is not False)
    est.add(codes, nbytes, keep, counted, lens, first_row)
    return ~keep | (counted & ((lens <= 0) | (lens + mt > max_model_len)))


def _plain_strings(texts):
    """A string column as one (large_)string array: chunks combined, dictionaries decoded."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    if pa.types.is_dictionary(texts.type):
        texts = texts.cast(texts.type.value_type)
    if pa.types.is_string_view(texts.type):
        texts = texts.cast(pa.large_string())
    return texts


def row_lengths(tok, inp, column) -> np.ndarray:
    """Prompt tokens of each row as prompts.py builds them; -1 for rows the runner refuses."""
    if inp.prompt_token_ids_column:
        return np.array([len(v) if v and v is not INVALID and None not in v else -1 for v in column_values(column)],
                        dtype=np.int64)
    if inp.messages_column:
        return chat_lengths(tok, column, inp)
    if inp.system_prompt is not None:  # [system, user=prompt] through the chat template
        keep = prompt_lengths(tok, column, lengths=False)
        values = column_values(column)
        convs = [chat_messages(inp, prompt=v) if k else None for v, k in zip(values, keep)]
        return tok.chat_lengths(convs, dict(inp.chat_template_kwargs or {}), inp.add_special_tokens is True)
    return prompt_lengths(tok, column, add_special_tokens=inp.add_special_tokens is not False)


def prompt_lengths(tok, texts, add_special_tokens: bool = True, lengths: bool = True) -> np.ndarray:
    """Tokens of each prompt the engine would run; -1 for the rows rows.build_unit refuses before
    tokenizing (null, invalid UTF-8, empty or whitespace only, as str.strip() sees it).
    ``lengths=False``: only the mask of the rows it keeps."""
    if pa.types.is_null(texts.type):
        return np.full(len(texts), -1, dtype=np.int64) if lengths else np.zeros(len(texts), dtype=bool)
    texts = _plain_strings(texts)
    try:
        texts.validate(full=True)  # invalid UTF-8 (writers do not all check): those rows are refused
    except pa.ArrowInvalid:
        values = column_values(texts)
        ok = np.array([v is not None and not isinstance(v, InvalidText) for v in values], dtype=bool)
        texts = pa.array([v if k else None for v, k in zip(values, ok)], pa.large_string())
    keep = pc.greater(pc.utf8_length(pc.utf8_trim(texts, characters=PY_WHITESPACE)), 0).fill_null(False)
    keep = np.asarray(keep, dtype=bool)
    if not lengths:
        return keep
    lens = tok.lengths(pc.if_else(keep, texts, pa.scalar(None, texts.type)), add_special_tokens)
    return np.where(keep, lens, -1)


def chat_lengths(tok, messages, inp=None) -> np.ndarray:
    """Tokens of each conversation; -1 for the rows rows.build_unit refuses (invalid UTF-8,
    null or empty, a null role or content, a failing chat template). ``inp``: the job's input
    section (system_prompt, chat_template_kwargs, add_special_tokens), as prompts.py uses it."""
    values = column_values(messages)
    convs = [v if v and v is not INVALID and all(m and m.get("role") is not None and m.get("content") is not None
                                                   for m in v) else None for v in values]
    if inp is None:
        return tok.chat_lengths(convs)
    convs = [chat_messages(inp, messages=c) if c is not None else None for c in convs]
    return tok.chat_lengths(convs, dict(inp.chat_template_kwargs or {}), inp.add_special_tokens is True)


# What str.strip() removes: rows.build_unit refuses a prompt that is only these.
PY_WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace())


def load_state(out_path: str) -> tuple[OutputDir, dict, list]:
    """(output dir, manifest, plan units) of an existing run; ConfigError naming what is wrong."""
    out = OutputDir(out_path.rstrip("/") if is_uri(out_path) else os.path.abspath(out_path))
    try:
        manifest = out.backend.read_json(out.manifest)
        units = out.backend.read_json(out.plan_dir + "/plan.json")["units"]
        if not isinstance(manifest, dict) or "fingerprint" not in manifest:
            raise ValueError("not a batchrun manifest")
    except FileNotFoundError:
        raise ConfigError(f"{out.path} is not a batchrun output directory (no _batchrun/manifest.json "
                          "or plan); has a run started there?") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{out.path}: its batchrun metadata is damaged ({e}); the part files are "
                          "untouched. Rerun the job with --restart to start over") from None
    return out, manifest, units


def status_report(out_path: str) -> tuple[str, ExitCode]:
    """(text, exit code): OK when every unit is committed, DAMAGED when a committed unit's part
    file is missing or damaged, else PENDING while units are not committed yet."""
    out, manifest, units = load_state(out_path)
    backend = out.backend
    commits = backend.read_commits()
    damaged = dict(commits.damaged)
    for unit, marker in commits.valid.items():
        if (why := backend.check_part(unit, marker, manifest.get("fingerprint"))) is not None:
            damaged[unit] = why
    done = {u: m for u, m in commits.valid.items() if u not in damaged}
    lines = [f"output:  {out.path}", f"job:     {manifest.get('job_file')} (fingerprint {manifest['fingerprint']})",
             f"created: {manifest.get('created')}"]
    total_rows = sum(u[4] for u in units)
    lines.append(f"units:   {len(done)}/{len(units)} committed")
    lines.append(f"rows:    {sum(m['rows'] for m in done.values())}/{total_rows} written, "
                 f"{sum(m['error_rows'] for m in done.values())} error rows")
    lines.append(f"tokens:  {sum(m['prompt_tokens'] for m in done.values())} prompt, "
                 f"{sum(m['output_tokens'] for m in done.values())} output")
    per = {}
    for index, adapter, known, _, rows in units:
        p = per.setdefault(_shard_name(adapter, known), [0, 0, 0, 0])
        p[0] += 1
        p[1] += rows
        if index in done:
            p[2] += 1
            p[3] += done[index]["error_rows"]
    lines += ["", _table(["shard", "units", "rows", "committed", "error rows"],
                         [[k, v[0], v[1], v[2], v[3]] for k, v in per.items()])]
    running = backend.running_tasks()
    lines += ["", f"running: {', '.join(running) if running else 'none'}"]
    if workers := worker_rows(out):
        lines += ["", _table(HEADER, workers)]
    orphans = backend.uncommitted_parts(len(units), commits)
    if damaged:
        shown = "; ".join(f"unit {u}: {why}" for u, why in sorted(damaged.items())[:3])
        lines.append(f"damaged: {len(damaged)} committed unit(s) whose part file is missing or damaged "
                     f"({shown}{' ...' if len(damaged) > 3 else ''}); the next run rewrites them")
    if orphans:
        lines.append(f"note: {len(orphans)} part file(s) finished but not yet committed (a run stopped "
                     "between writing and committing); the next run rewrites them")
    complete = len(done) == len(units)
    lines.append("complete" if complete else "incomplete: rerun the same command to finish")
    code = ExitCode.OK if complete else ExitCode.DAMAGED if damaged else ExitCode.PENDING
    return "\n".join(lines), code


def show_rows(out_path: str, limit: int, prompts: bool) -> str:
    out, manifest, _ = load_state(out_path)
    backend = out.backend
    done = {u: m for u, m in backend.read_commits().valid.items()
            if backend.check_part(u, m, manifest.get("fingerprint")) is None}
    if not done:
        return "(no units committed yet)"
    # A few committed part files per shard (not the whole dataset), then round-robin over shards
    # so every adapter shows up.
    per_shard: dict = {}
    for unit in sorted(done):
        files = per_shard.setdefault(done[unit].get("adapter"), [])
        if sum(n for _, n in files) < limit:
            files.append((unit, done[unit]["rows"]))
    queues = [[r for unit, _ in files for r in backend.read_part(unit).to_pylist()] for files in per_shard.values()]
    rows = []
    while len(rows) < limit and any(queues):
        for q in queues:
            if q and len(rows) < limit:
                rows.append(q.pop(0))
    if not rows:  # committed units of no rows: make_plan's one unit for an input without rows
        return "(no rows: the job's input has none)"
    prompt_of = _prompts_for(out, manifest, [r["id"] for r in rows]) if prompts else {}
    lines = []
    for r in rows:
        configured = (manifest.get("job") or {}).get("adapters") or {}
        name = r["adapter"] or "base"
        if r["adapter"] and r["adapter"] not in configured:
            name += " (unknown adapter: not under adapters:, so the row was not run)"
        head = f"[{name}] id={r['id']}"
        if r["id"] in prompt_of:
            head += f"  prompt={prompt_of[r['id']]!r}"
        body = (f"-> {r['output_text']!r} ({r['finish_reason']}, {r['output_tokens']} tokens)"
                if r["finish_reason"] != "error" else f"-> ERROR: {r['error']}")
        lines.append(f"{head}\n    {body}")
    return "\n".join(lines)


def _prompts_for(out: OutputDir, manifest: dict, ids: list) -> dict:
    """Prompts of the given ids, found through the stored plan (works for default ids too)."""
    job = manifest.get("job") or {}
    inp = job.get("input") or {}
    col = inp.get("prompt_column") or inp.get("messages_column")
    plan = out.backend.load_plan()
    if plan is None:
        return {}
    wanted, found = set(ids), {}
    reader = RowReader(plan.files, [c for c in (col, inp.get("id_column")) if c],
                       storage_options=StorageOptions(**(inp.get("storage_options") or {})))
    for u in plan.units:
        rf, ri = plan.unit_rows(u)
        try:
            rows = reader.read(rf, ri)
        except (OSError, OutputIOError):  # the inputs moved or the store refuses: show no prompts
            return {}
        for k in range(u.rows):
            rid = rows[inp["id_column"]][k] if inp.get("id_column") else f"{plan.file_names[rf[k]]}:{ri[k]}"
            if rid in wanted:
                found[rid] = rows[col][k]
        if len(found) == len(wanted):
            break
    return found
