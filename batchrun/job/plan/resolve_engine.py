"""What engine.device / engine.dtype (and the weights' quantization) resolve to on this node.

The job fingerprint hashes these settings as written, and ``auto`` is the same text on a CPU
node (float32) and on a GPU node (the config's torch_dtype, e.g. bfloat16). The manifest
therefore also records what they resolved to when the output was started, and a run that would
resolve them differently is refused (JobChanged, exit 5): one output, one numerics.

Resolution reads only the model's config and ``torch.cuda.is_available()`` (no weights). The
dtype rule is the loader's own (engine/config.py dtype_name); tests/runner/test_resolved_engine.py
checks the two agree for every device and setting.
"""
from __future__ import annotations

import json
import os

from batchrun.engine.config import dtype_name
from batchrun.job.jobfile.spec import JobSpec

# Keys of the manifest's "engine_resolved" record, in the order messages name them.
KEYS = ("device", "dtype", "quantization")


def cuda_available() -> bool:
    import torch  # `batchrun run` has imported it on the preload thread by now
    return torch.cuda.is_available()


def resolve_device(name: str) -> str:
    """engine.device as the engine resolves it (engine.py resolve_device): auto -> cuda if one
    is visible, else cpu."""
    if name != "auto":
        return name
    return "cuda" if cuda_available() else "cpu"


def weight_quantization(model_dir: str, quantization: str | None = None) -> str:
    """The checkpoint's quantization_config.quant_method, else engine.quantization ("none" for
    neither): the weights' format decides numerics as the dtype does."""
    with open(os.path.join(model_dir, "config.json")) as f:  # read and checked by inspect_model already
        q = json.load(f).get("quantization_config")
    if not isinstance(q, dict):
        return quantization or "none"
    return str(q.get("quant_method") or "unknown")


def resolve_engine(spec: JobSpec, model_config) -> dict[str, str]:
    """{"device", "dtype", "quantization"} as this node would run the job."""
    device = resolve_device(spec.engine.device)
    return {"device": device,
            "dtype": dtype_name(spec.engine.dtype, getattr(model_config, "torch_dtype", None), device),
            "quantization": weight_quantization(spec.model, spec.engine.quantization)}


def resolution_changes(started: dict, here: dict) -> list[str]:
    """One phrase per key the two records both hold and disagree on."""
    return [f"engine.{k} resolved to {here[k]} on this node, the output was started with {started[k]}"
            for k in KEYS if k in started and k in here and started[k] != here[k]]


def changed_message(out_path: str, changes: list[str]) -> str:
    return (f"output.path: {out_path} would mix numerics: {'; '.join(changes)}. Resume it where these "
            "resolve as they did (a node of the first kind; CUDA_VISIBLE_DEVICES= makes device: auto "
            "resolve to cpu), or rerun with --restart to discard its results, or choose another output.path")
