"""Load a local Hugging Face model directory into our CausalLM (models/decoder.py).

safetensors only (single file or sharded with model.safetensors.index.json), read through mmap;
pickled checkpoints are refused, never unpickled; no code from the model directory is run.
The model is built on the meta device in the target dtype and materialised once on the target
device (no float32 copy first, no transformers init work), and each HF tensor is copied once,
converting dtype on the way, into its (possibly fused) slice. On a GPU the copies go through
two pinned staging buffers (stage.py): the next tensor is read from the page cache while the
previous one is on its way to the device.
"""
from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from batchrun.engine.config import dtype_name
from batchrun.errors import ModelLoadError
from batchrun.engine.models.checkpoint import (canonical_name, check_checkpoint,  # noqa: F401
                                              inspect_model)  # (inspect_model re-exported)
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.models.decoder import CausalLM
from batchrun.engine.models.stage import StagedCopier

# HF name suffix -> (our module suffix, slice index within the fused weight)
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.shared_expert.gate_proj": ("mlp.shared_expert.gate_up_proj", 0),  # Qwen2-MoE
    "mlp.shared_expert.up_proj": ("mlp.shared_expert.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# one expert's projection in a per-expert checkpoint (canonical names, checkpoint.py) -> its
# part of the stacked weights: gate = rows [0, I) of gate_up_proj[e], up = rows [I, 2I)
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    name = dtype_name(name, cfg.torch_dtype, device.type)
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ModelLoadError(f"unsupported dtype {name!r} (float32, float16, bfloat16)")
    return table[name]


def our_name(hf_name: str) -> tuple[str, int | None]:
    """HF tensor name -> (our parameter name, fused slice index or None)."""
    m = _LAYER.match(hf_name)
    if m:
        n, mod, kind = m.groups()
        if mod in FUSED:
            ours, idx = FUSED[mod]
            return f"model.layers.{n}.{ours}.{kind}", idx
    return hf_name, None


def _materialise(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 max_position: int) -> CausalLM:
    """Build on the meta device in ``dtype``, then allocate (uninitialised) storage on the target
    device once."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_position)
    model.to(dtype)  # on meta: no memory, no copy
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    for rotary in model.model.rotaries():
        rotary.init_cache(device)
    return model


@torch.no_grad()
def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_position: int,
                 seed: int = 0) -> CausalLM:
    """Random weights of a real model's shape, built directly on the device (benchmarks: no
    weights can be downloaded). Matrices ~ N(0, 0.02), norms scaling by 1 (weight 1, or 0 where
    the norm scales by 1 + weight), like HF's initialisation."""
    model = _materialise(cfg, device, dtype, max_position)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and name.endswith("norm.weight"):
            p.fill_(1.0 - cfg.norm_offset)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


@torch.no_grad()
def load_model(path: str | Path, device: torch.device, dtype: torch.dtype,
               max_position: int) -> CausalLM:
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory not found")
    cfg = ModelConfig.from_dir(model_dir)
    found = check_checkpoint(model_dir, cfg)
    model = _materialise(cfg, device, dtype, max_position)
    params = dict(model.named_parameters(remove_duplicate=False))
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (f, _, stored) in found.items():
        if not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            by_file.setdefault(f, []).append((name, stored))
    with ExitStack() as files, StagedCopier(device, dtype) as copier:  # files stay open until copied
        for f, names in by_file.items():
            sf = files.enter_context(safe_open(str(f), framework="pt"))  # mmap
            for name, stored in names:
                copier.copy(hf_target(model, params, name),
                            lambda sf=sf, stored=stored: sf.get_tensor(stored))
    return model.eval()


def hf_target(model, params: dict, hf_name: str) -> torch.Tensor:
    """The part of our parameter that one HF checkpoint tensor fills (a slice for fused layers,
    one expert's rows of the stacked experts)."""
    m = _EXPERT.match(hf_name)
    if m:
        experts, e, proj = m.groups()
        if proj == "down":
            return params[f"{experts}.down_proj"][int(e)]
        gate_up = params[f"{experts}.gate_up_proj"][int(e)]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if proj == "gate" else gate_up[half:]
    ours, idx = our_name(hf_name)
    param = params[ours]
    if idx is None:
        return param
    sizes = model.get_submodule(ours.rsplit(".", 1)[0]).output_sizes
    start = sum(sizes[:idx])
    return param[start:start + sizes[idx]]


def copy_hf_tensor(model, params: dict, hf_name: str, src: torch.Tensor) -> None:
    """Copy one HF checkpoint tensor into our parameter (a slice of it for fused layers)."""
    hf_target(model, params, hf_name).copy_(src)


@torch.no_grad()
def model_from_hf_state(cfg: ModelConfig, state: dict, device, dtype, max_position: int):
    """Our model holding the weights of an in-memory HF model (GPU parity tests)."""
    model = _materialise(cfg, device, dtype, max_position)
    params = dict(model.named_parameters(remove_duplicate=False))
    for stored, t in state.items():
        name = canonical_name(stored, cfg)
        if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        copy_hf_tensor(model, params, name, t)
    return model.eval()
