"""Fingerprint of everything that decides a job's outputs, so a rerun can tell it is the same job.

Parts: model, adapters, inputs, sampling, engine settings that change outputs (device, dtype,
max_model_len), and the input layout (columns, rows_per_unit: they decide the work units).
Performance-only settings (max_num_seqs, max_loras, enforce_eager, ...) are left out so they
can be tuned between a crash and the rerun.
The engine settings are hashed as written; what ``auto`` resolves to on the node (device, dtype,
the checkpoint's quantization) is recorded beside the fingerprint in the manifest and checked on
every resume (resolve_engine.py), which keeps the fingerprints of existing outputs unchanged.
max_model_len is hashed as config.json resolves it (auto -> the model's context): an output
started with the old default 2048 resumes under auto when the model's context is 2048 (same
limit, same error rows) and is refused, naming the old value to set, when it is not
(prepare.py max_model_len_hint).

Files are identified by content, not mtime, so a model copied to node-local scratch by each Slurm
task still matches: small files (<= 64 MiB: configs, tokenizers, adapters) are hashed whole;
larger ones (weights, big inputs) by size plus sampled bytes (the head, which holds a safetensors
header, the tail, which holds a Parquet footer, and 16 spread 64 KiB blocks).
"""
from __future__ import annotations

import hashlib
import json
import os

from batchrun.job.jobfile.spec import JobSpec, SamplingSpec

# Sampling fields fingerprinted as before #13; newer fields count only when set, so a job that
# does not use them keeps its fingerprint (and resumes) across the upgrade.
_FIRST_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed")
_SAMPLING_DEFAULTS = SamplingSpec()


# Input fields added with #13: in the layout part only when set (old jobs keep their fingerprint).
_NEW_INPUT = {"passthrough_columns": (), "prompt_token_ids_column": None, "system_prompt": None,
              "chat_template_kwargs": {}, "add_special_tokens": "auto"}


def _sampling_part(sampling: SamplingSpec) -> dict:
    return {k: v for k, v in sampling.__dict__.items()
            if k != "from_generation_config" and (k in _FIRST_SAMPLING or v != getattr(_SAMPLING_DEFAULTS, k))}

SMALL_FILE = 64 << 20
_BLOCK = 64 << 10


def file_digest(path: str) -> str:
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= SMALL_FILE:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(4 << 20))
            for i in range(16):
                f.seek(size * (i + 1) // 18)
                h.update(f.read(_BLOCK))
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return h.hexdigest()


# Files that can change what a model/adapter directory computes (READMEs, images do not).
_RELEVANT = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken")


def dir_digest(path: str) -> str:
    """Digest of the relevant files directly in a model/adapter directory (names + contents)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.startswith(".") or not name.endswith(_RELEVANT) or not os.path.isfile(full):
            continue
        h.update(name.encode() + b"\0" + file_digest(full).encode())
    return h.hexdigest()


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def job_fingerprint(spec: JobSpec, files: list[str], file_names: list[str],
                    override_columns: list[str], digests: list[str] | None = None,
                    max_model_len: int | None = None) -> dict[str, str]:
    """{part: digest}; the manifest stores it, so a mismatch can say which part changed.

    ``digests``: the input files' file_digest, when the caller already has them (prepare pins them).
    ``max_model_len``: engine.max_model_len as the model's config.json resolves it
    (engine/config.py context_max_model_len); required when the job says auto.
    """
    inp, eng = spec.input, spec.engine
    max_model_len = eng.max_model_len if max_model_len is None else max_model_len
    if not isinstance(max_model_len, int):
        raise ValueError("job_fingerprint: max_model_len auto needs the resolved value")
    digests = digests if digests is not None else [file_digest(f) for f in files]
    return {
        "model": dir_digest(spec.model),
        "adapters": _digest({name: dir_digest(p) for name, p in spec.adapters.items()}),
        "inputs": _digest([[n, d] for n, d in zip(file_names, digests)]),
        "sampling": _digest({**_sampling_part(spec.sampling), "override_columns": list(override_columns)}),
        # quantization and kv_cache_dtype only when set: outputs started before they existed
        # keep their fingerprints
        "engine": _digest({"device": eng.device, "dtype": eng.dtype, "max_model_len": max_model_len}
                          | ({"quantization": eng.quantization} if eng.quantization else {})
                          | ({"kv_cache_dtype": eng.kv_cache_dtype}
                             if eng.kv_cache_dtype != "auto" else {})),
        "layout": _digest({k: getattr(inp, k) for k in
                           ("id_column", "prompt_column", "messages_column", "adapter_column", "rows_per_unit")}
                          | {k: getattr(inp, k) for k in _NEW_INPUT if getattr(inp, k) != _NEW_INPUT[k]}),
    }


def combine(parts: dict[str, str]) -> str:
    return _digest(parts)[:16]


PART_NAMES = {
    "model": "the model directory (model:)",
    "adapters": "the adapters (adapters:)",
    "inputs": "the input files (input.path)",
    "sampling": "the sampling settings (sampling:, or the per-row override columns)",
    "engine": "engine.device / engine.dtype / engine.max_model_len / engine.quantization / "
              "engine.kv_cache_dtype",
    "layout": "the input columns or input.rows_per_unit",
}
