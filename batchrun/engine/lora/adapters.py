"""PEFT LoRA adapter directories: validate against the base model, then load.

`inspect_adapter` reads only adapter_config.json and the safetensors header (names, shapes,
dtypes; no weights), so `batchrun plan` can validate every adapter of a job cheaply and a bad
adapter fails before any GPU work. `load_adapter` re-validates and reads the weights, folding the
LoRA scaling into B so the kernels compute y += (x @ A^T) @ B'^T with B' = scaling * B.

The weights are the source of truth for which modules an adapter touches; the config must agree
with them (peft's matching rules, see peft_config.py), else the adapter is refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from batchrun.engine.lora.experts import EXPERT_MODULES, expert_targets, is_expert_key, per_expert
from batchrun.engine.lora.peft_config import (EMBEDDING_MODULES, PeftLoraConfig, adapter_error, check_rank,
                                              module_key, peft_modules)
from batchrun.engine.models.checkpoint import VISION, text_tower_name
from batchrun.engine.models.config import SUPPORTED
from batchrun.engine.safetensors_header import HeaderError, read_header

if TYPE_CHECKING:  # torch is needed only to load weights (safetensors imports it then)
    import torch

_WEIGHTS = "adapter_model.safetensors"
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<proj>\w+)$")


@dataclass(frozen=True)
class LoRATarget:
    """One slice of our fused Linear that one PEFT module of one layer fills, e.g. layer 3
    k_proj = slice 1 of qkv_proj; Phi-3's whole qkv_proj gives three, each of B's rows `rows`."""
    layer: int
    peft_module: str  # "k_proj"
    module: str       # "qkv_proj"
    slice: int        # 1
    rank: int
    scaling: float    # alpha / r, or alpha / sqrt(r) with use_rslora
    key_a: str        # tensor names in adapter_model.safetensors
    key_b: str
    rows: tuple[int, int] | None = None  # the slice's rows of B (a PEFT module over all slices)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: Path
    max_rank: int
    targets: tuple[LoRATarget, ...]  # sorted by (layer, module, slice)

    @property
    def modules(self) -> frozenset[tuple[int, str]]:
        """(layer, fused module) pairs this adapter touches."""
        return frozenset((t.layer, t.module) for t in self.targets)


@dataclass
class LoRAWeights:
    info: AdapterInfo
    # (layer, module, slice) -> (A [r, in], B [out_slice, r] with scaling folded in), CPU
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]


def _slice_sizes(cfg) -> dict[str, list[int]]:
    """Our fused Linear -> the out_features of its slices."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    i = cfg.intermediate_size
    return {"qkv_proj": [q, kv, kv], "o_proj": [cfg.hidden_size],
            "gate_up_proj": [i, i], "down_proj": [cfg.hidden_size]}


def module_shapes(cfg) -> dict[str, tuple[int, int]]:
    """peft module -> (in_features, out_features) of the base model's Linear."""
    h, sizes = cfg.hidden_size, _slice_sizes(cfg)
    (q, kv, _), (i, _) = sizes["qkv_proj"], sizes["gate_up_proj"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
            "qkv_proj": (h, q + 2 * kv), "gate_up_proj": (h, 2 * i)}


def _routed(cfg, layer: int) -> bool:
    """Whether `layer` of the base runs routed experts in place of the dense MLP."""
    is_moe = getattr(cfg, "is_moe_layer", None)
    return is_moe is not None and is_moe(layer)


def _base_desc(cfg) -> str:
    return (f"{getattr(cfg, 'model_type', '?')} base with hidden_size={cfg.hidden_size}, "
            f"intermediate_size={cfg.intermediate_size}, num_hidden_layers={cfg.num_hidden_layers}")


def _read_header(name: str, path: Path) -> dict[str, list[int]]:
    weights = path / _WEIGHTS
    if not weights.is_file():
        for pickled in ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth"):
            if (path / pickled).exists():
                raise adapter_error(name, path, f"{pickled} is a pickle file, which batchrun "
                                    "never loads (unpickling can run arbitrary code); convert it "
                                    f"to {_WEIGHTS} (load it with peft once and save_pretrained("
                                    "..., safe_serialization=True))")
        raise adapter_error(name, path, f"{_WEIGHTS} not found next to adapter_config.json")
    try:
        return {k: list(shape) for k, (_, shape) in read_header(weights).items()}
    except (OSError, HeaderError) as e:  # torch-free: validation and `plan` never import torch
        raise adapter_error(name, path, f"cannot read {_WEIGHTS}: {e}") from None


def _text_tower_key(key: str, cfg) -> str:
    """An image-text model's adapter key for its text tower, as a causal LM's key."""
    if getattr(cfg, "weight_prefix", "model.") == "model.":
        return key
    peft = "base_model.model."
    return peft + text_tower_name(key[len(peft):]) if key.startswith(peft) else key


def _refuse_key(name: str, path: Path, key: str, cfg) -> None:
    """Explain a tensor name that is not a Linear LoRA A/B weight of a decoder layer."""
    if VISION.match(key.removeprefix("base_model.model.")):
        why = ("is LoRA on the vision tower or projector; batchrun runs the text tower of an "
               "image-text model only (retrain with target_modules limited to the language model)")
    elif ".mlp.shared_expert" in key:
        module = key.removeprefix("base_model.model.").split(".lora_")[0]
        why = (f"is LoRA on {module}, a Qwen2-MoE shared expert, which batchrun does not apply "
               "yet; use an adapter on the attention projections (target_modules q/k/v/o_proj), "
               "or merge this one into the base model")
    elif "lora_magnitude_vector" in key:
        why = "is a DoRA magnitude vector; DoRA is not supported (merge the adapter into the base)"
    elif "lora_" in key and any(f".{m}." in key for m in EMBEDDING_MODULES):
        why = ("is LoRA on the embedding or lm_head, which is not supported; retrain without "
               "embed_tokens/lm_head in target_modules or merge the adapter into the base model")
    elif key.endswith(".bias"):
        why = "is a bias term; LoRA bias is not supported (retrain with bias='none', lora_bias=false)"
    elif ".modules_to_save." in key:
        why = "is a modules_to_save weight, which is not supported (merge the adapter)"
    else:
        why = (f"is not a LoRA weight batchrun knows (expected base_model.model.model.layers.N."
               f"<self_attn|mlp>.<{'|'.join(peft_modules(cfg))}>.lora_<A|B>.weight for a "
               f"{getattr(cfg, 'model_type', 'llama')}-family model)")
    raise adapter_error(name, path, f"tensor {key!r} {why}")


def inspect_adapter(name: str, path, model_config, max_lora_rank: int) -> AdapterInfo:
    """Validate an adapter directory against the base model without loading weights."""
    path = Path(path)
    if not path.is_dir():
        raise adapter_error(name, path, "not a directory; give the PEFT adapter directory")
    cfg = model_config
    pc = PeftLoraConfig.read(name, path)
    if pc.base_model_class:
        model_type = getattr(cfg, "model_type", None)
        family = SUPPORTED.get(pc.base_model_class,
                               pc.base_model_class.removesuffix("ForCausalLM").lower())
        if family == "gemma3":  # the image-text class: its text tower is what runs
            family = "gemma3_text"
        if model_type and family != model_type:
            raise adapter_error(name, path, f"adapter_config.json says it was trained on a "
                                f"{pc.base_model_class}, but the base model is {model_type!r}; "
                                "use an adapter trained for this base model")
    if pc.target_parameters and getattr(cfg, "experts", None) is None:
        raise adapter_error(name, path, f"adapter_config.json target_parameters="
                            f"{list(pc.target_parameters)!r}: LoRA on raw parameters is supported on "
                            "a mixture-of-experts block's router and experts only, and this base "
                            f"({getattr(cfg, 'model_type', '?')}) has none; use an adapter on "
                            "Linear modules (target_modules)")
    header, stored, prefix = {}, {}, "model."
    for k, v in _read_header(name, path).items():
        if not pc.ignores(k):
            ck = _text_tower_key(k, cfg)
            if ck != k:  # where the adapter's model kept the decoder (an image-text model's text tower)
                prefix = k.removeprefix("base_model.model.").split("layers.")[0]
            header[ck], stored[ck] = v, k

    def peft_key(layer: int, proj: str) -> str:
        # the module's name in the model the adapter was trained on: what its config's
        # target_modules and patterns were matched against
        return prefix + module_key(layer, proj).removeprefix("model.")

    n_layers = cfg.num_hidden_layers
    shapes, modules = module_shapes(cfg), peft_modules(cfg)

    # Group tensors by module: (layer, peft module) -> {"A": key, "B": key}
    found: dict[tuple[int, str], dict[str, str]] = {}
    parsed = {}
    for key in header:
        m = _LORA_KEY.match(key)
        lm = _LAYER_MODULE.match(m.group("module")) if m else None
        if lm is not None and modules.get(lm.group("proj"), ("",))[0] == lm.group("parent"):
            parsed[key] = (m, lm)
    moe_targets = expert_targets(name, path, cfg, pc, header, stored, max_lora_rank)
    bad = [k for k in header if k not in parsed and not is_expert_key(k)]
    if bad:  # explain a LoRA-looking key first (e.g. embedding LoRA, not its saved base weight)
        _refuse_key(name, path, min(bad, key=lambda k: ("lora_" not in k, k)), cfg)
    for key in sorted(parsed):
        m, lm = parsed[key]
        layer = int(lm.group("layer"))
        if layer >= n_layers:
            raise adapter_error(name, path, f"tensor {key!r} is for layer {layer}, but the base "
                                f"model has {n_layers} layers ({_base_desc(cfg)}): the adapter "
                                "was made for a different base model")
        if lm.group("parent") == "mlp" and _routed(cfg, layer):
            raise adapter_error(name, path, f"tensor {key!r} is LoRA on {peft_key(layer, lm.group('proj'))}, "
                                f"but layer {layer} of this {cfg.model_type} base routes through "
                                "experts and has no such Linear: the adapter was made for a "
                                "different base model")
        found.setdefault((layer, lm.group("proj")), {})[m.group("ab")] = key

    if not found and not moe_targets:
        raise adapter_error(name, path, f"{_WEIGHTS} holds no LoRA weights")
    for t in moe_targets:
        pkey = f"model.layers.{t.layer}.{t.peft_module}"
        if not pc.targets_parameter(pkey):
            raise adapter_error(name, path, f"{_WEIGHTS} has weights for {pkey}, which "
                                "adapter_config.json target_parameters do not select; the config "
                                "does not belong to these weights")
    targets = list(moe_targets)
    for (layer, proj), ab in sorted(found.items()):
        mkey = peft_key(layer, proj)
        if set(ab) != {"A", "B"}:
            raise adapter_error(name, path, f"{mkey} has lora_{''.join(ab)} but not both A and "
                                "B; the weights file is incomplete")
        if pc.target_modules is not None and not pc.is_target(mkey, n_layers, modules):
            raise adapter_error(name, path, f"{_WEIGHTS} has weights for {mkey}, which "
                                "adapter_config.json target_modules/layers_to_transform do not "
                                "select; the config does not belong to these weights")
        in_f, out_f = shapes[proj]
        (ra, ka), (ob, rb) = header[ab["A"]], header[ab["B"]]
        if ka != in_f or ob != out_f:
            raise adapter_error(name, path, f"shape mismatch for {mkey}: lora_A {[ra, ka]} and "
                                f"lora_B {[ob, rb]}, but the base model's {proj} is [out={out_f}, "
                                f"in={in_f}] ({_base_desc(cfg)}); the adapter was made for a "
                                "different base model")
        if ra != rb:
            raise adapter_error(name, path, f"{mkey}: lora_A rank {ra} != lora_B rank {rb}")
        check_rank(name, path, mkey, ra, pc, max_lora_rank)
        parent, module, sl = modules[proj]
        scaling = pc.scaling_for(mkey, ra)
        key_a, key_b = stored[ab["A"]], stored[ab["B"]]
        if sl is not None:
            targets.append(LoRATarget(layer, proj, module, sl, ra, scaling, key_a, key_b))
            continue
        start = 0  # one PEFT module over all slices of ours: one target per slice
        for k, size in enumerate(_slice_sizes(cfg)[module]):
            targets.append(LoRATarget(layer, proj, module, k, ra, scaling, key_a, key_b,
                                      (start, start + size)))
            start += size
    if pc.target_modules is not None:  # a selected module without weights: file incomplete
        for layer in range(n_layers):
            for proj in modules:
                if modules[proj][0] == "mlp" and _routed(cfg, layer):
                    continue  # a routed layer has no dense MLP for a target name to select
                if (layer, proj) not in found and pc.is_target(peft_key(layer, proj), n_layers,
                                                               modules):
                    raise adapter_error(name, path, f"adapter_config.json selects "
                                        f"{peft_key(layer, proj)} but {_WEIGHTS} has no "
                                        "weights for it; the weights file is incomplete")
    targets.sort(key=lambda t: (t.layer, t.module, t.slice))
    return AdapterInfo(name, path, max(t.rank for t in targets), tuple(targets))


def load_adapter(name: str, path, model_config, max_lora_rank: int,
                 dtype: torch.dtype | None = None) -> LoRAWeights:
    """Validate, then read the weights (CPU). B gets the scaling folded in (computed in fp32,
    then cast to `dtype`; None keeps the file's dtype)."""
    info = inspect_adapter(name, path, model_config, max_lora_rank)
    weights = {}
    with safe_open(str(info.path / _WEIGHTS), framework="pt") as f:
        for t in info.targets:
            a, b = f.get_tensor(t.key_a), f.get_tensor(t.key_b)
            if t.rows is not None:
                b = b[t.rows[0]:t.rows[1]]
            if t.module in EXPERT_MODULES:  # [E, r, in], [E, out, r] (the router: E = 1)
                a, b = per_expert(a, b, t.rank)
            out_dtype = dtype or b.dtype
            b = (b.float() * t.scaling).to(out_dtype).contiguous()
            weights[(t.layer, t.module, t.slice)] = (a.to(out_dtype).contiguous(), b)
    return LoRAWeights(info, weights)
