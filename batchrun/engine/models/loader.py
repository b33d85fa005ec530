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
from batchrun.engine.models.quant import HF_SLICES, check_fused_blocks, with_quantization
from batchrun.engine.models.stage import StagedCopier
from batchrun.engine.layers.fp8 import FP8, make_fp8, quantize_rows, weight_scale_shape
from batchrun.engine.layers.linear import Linear

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
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|weight_scale|weight_scale_inv|"
                    r"input_scale)$")
# an FP8 KV cache's per-layer scales (compressed-tensors kv_cache_scheme)
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v)_scale$")
# FP8 tensor names -> ours (HF fp8 checkpoints call the dequantization scale weight_scale_inv)
_SCALE = {"weight_scale_inv": "weight_scale"}
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
        kind = _SCALE.get(kind, kind)
        if mod in FUSED:
            ours, idx = FUSED[mod]
            return f"model.layers.{n}.{ours}.{kind}", idx
        return f"model.layers.{n}.{mod}.{kind}", None
    return hf_name, None


def _apply_quant(model: CausalLM, cfg: ModelConfig) -> None:
    """Make each decoder Linear the scheme quantizes FP8 (on the meta device). A fused Linear
    is FP8 only when all of its HF slices are; a mix is refused naming the module."""
    scheme = cfg.quant
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        layer, ours = name.split(".self_attn.") if ".self_attn." in name else name.split(".mlp.")
        kind = ("self_attn." if ".self_attn." in name else "mlp.") + ours
        hf = ([f"{layer}.{m}" for m in HF_SLICES.get(kind, (kind,))]
              if not cfg.fused_checkpoint else [name])
        quantized = [scheme.quantizes(m) for m in hf]
        if any(quantized) != all(quantized):
            raise ModelLoadError(
                f"quantization_config quantizes {[m for m, q in zip(hf, quantized) if q]} but "
                f"not {[m for m, q in zip(hf, quantized) if not q]}, which batchrun runs as one "
                f"fused projection {name}; quantize all of them or none")
        if all(quantized):
            check_fused_blocks(scheme, module.output_sizes, name, "quantization_config")
            make_fp8(module, scheme, weight_scale_shape(scheme, module.out_features,
                                                        module.in_features))


def _materialise(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 max_position: int) -> CausalLM:
    """Build on the meta device in ``dtype``, then allocate (uninitialised) storage on the target
    device once."""
    with torch.device("meta"):
        model = CausalLM(cfg, max_position)
    model.to(dtype)  # on meta: no memory, no copy
    if cfg.quant is not None:
        _apply_quant(model, cfg)
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
        if p.dtype == FP8 or name.endswith(("weight_scale", "input_scale")):
            continue  # below: an FP8 Linear quantizes its random weight
        if p.dim() == 1 and name.endswith("norm.weight"):
            p.fill_(1.0 - cfg.norm_offset)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():
        if isinstance(module, Linear) and module.quant is not None:
            if module.quant.weights != "channel" or module.input_scale is not None:
                raise ValueError("random FP8 weights are per-channel with dynamic activations")
            w = torch.empty(module.weight.shape, dtype=dtype, device=device).normal_(
                0.0, 0.02, generator=gen)
            quantize_rows(w, module.weight, module.weight_scale)
    return model.eval()


@torch.no_grad()
def load_model(path: str | Path, device: torch.device, dtype: torch.dtype,
               max_position: int, quantization: str | None = None) -> CausalLM:
    """quantization: engine.quantization (fp8: FP8 linear layers from an unquantized checkpoint)."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory not found")
    cfg = with_quantization(ModelConfig.from_dir(model_dir), quantization)
    found = check_checkpoint(model_dir, cfg)
    model = _materialise(cfg, device, dtype, max_position)
    params = dict(model.named_parameters(remove_duplicate=False))
    entries = [(name, f, stored) for name, (f, _, stored) in found.items()
               if not (name == "lm_head.weight" and cfg.tie_word_embeddings)]
    on_the_fly = cfg.quant is not None and not cfg.quant.stored
    with ExitStack() as files:  # files stay open until copied
        opened = {}

        def open_file(f):
            if f not in opened:
                opened[f] = files.enter_context(safe_open(str(f), framework="pt"))  # mmap
            return opened[f]

        # quantizing at load time goes layer by layer: only one layer's weights ever exist in
        # the model dtype (a bf16 scratch), so a model that fits in FP8 loads in FP8
        groups = _by_layer(entries) if on_the_fly else [entries]
        input_scales: dict[str, float] = {}
        for group in groups:
            to_quantize = []
            with StagedCopier(device, dtype) as copier:
                for name, f, stored in group:
                    sf = open_file(f)
                    ours, _ = our_name(name)
                    load = (lambda sf=sf, stored=stored: sf.get_tensor(stored))
                    kv = _KV_SCALE.match(name)
                    if kv:  # an FP8 KV cache's scales (used when engine.kv_cache_dtype is fp8)
                        attn = model.model.layers[int(kv.group(1))].self_attn.attn
                        scales = list(attn.checkpoint_kv_scales)
                        scales[kv.group(2) == "v"] = float(load().float().reshape(-1)[0])
                        attn.checkpoint_kv_scales = tuple(scales)
                        continue
                    if ours.endswith(".input_scale"):  # a fused layer takes its slices' largest
                        value = float(load().float().max())
                        input_scales[ours] = max(value, input_scales.get(ours, value))
                        continue
                    target = hf_target(model, params, name)
                    if on_the_fly and target.dtype == FP8:
                        scratch = torch.empty(target.shape, dtype=dtype, device=device)
                        copier.copy(scratch, load)
                        to_quantize.append((scratch, target, scale_target(model, params, name)))
                    else:
                        copier.copy(target, (lambda load=load, target=target, name=name:
                                             fit_scale(load(), target, name)))
            for scratch, q, scale in to_quantize:
                quantize_rows(scratch, q, scale)
        for ours, value in input_scales.items():
            params[ours].fill_(value)
    return model.eval()


def _by_layer(entries: list) -> list[list]:
    """Checkpoint entries grouped by decoder layer (the rest first), in file order within each."""
    groups: dict[int, list] = {}
    for entry in entries:
        m = _LAYER.match(entry[0])
        groups.setdefault(int(m.group(1)) if m else -1, []).append(entry)
    return [groups[k] for k in sorted(groups)]


def fit_scale(src: torch.Tensor, target: torch.Tensor, name: str) -> torch.Tensor:
    """A checkpoint scale in our layout: [n, 1] per-row scales as [n]; a per-tensor scale
    ([1] or []) repeated over its rows (check_checkpoint has checked the shapes)."""
    if not name.endswith(("weight_scale", "weight_scale_inv")) or src.shape == target.shape:
        return src
    if src.numel() == 1:
        return src.reshape(1).expand(target.shape)
    return src.reshape(target.shape)


def hf_target(model, params: dict, hf_name: str) -> torch.Tensor:
    """The part of our parameter that one HF checkpoint tensor fills (a slice for fused layers:
    its rows of the weight and of per-row scales, its row blocks of block scales; one expert's
    rows of the stacked experts)."""
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
    module = model.get_submodule(ours.rsplit(".", 1)[0])
    sizes = module.output_sizes
    start, end = sum(sizes[:idx]), sum(sizes[:idx + 1])
    if ours.endswith(".weight_scale") and module.quant.weights == "block":
        bn = module.quant.block[0]  # whole blocks per slice (quant.check_fused_blocks)
        return param[start // bn:end // bn]
    return param[start:end]


def scale_target(model, params: dict, hf_name: str) -> torch.Tensor:
    """The per-row scales of the rows `hf_name` (a weight) fills."""
    ours, idx = our_name(hf_name)
    scale = params[ours[:-len("weight")] + "weight_scale"]
    if idx is None:
        return scale
    sizes = model.get_submodule(ours.rsplit(".", 1)[0]).output_sizes
    return scale[sum(sizes[:idx]):sum(sizes[:idx + 1])]


def copy_hf_tensor(model, params: dict, hf_name: str, src: torch.Tensor) -> None:
    """Copy one HF checkpoint tensor into our parameter (a slice of it for fused layers); an
    unquantized weight of an FP8 Linear is quantized per row on the way."""
    target = hf_target(model, params, hf_name)
    if target.dtype == FP8 and src.dtype != FP8:
        quantize_rows(src.to(target.device), target, scale_target(model, params, hf_name))
    else:
        target.copy_(fit_scale(src, target, hf_name))


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
