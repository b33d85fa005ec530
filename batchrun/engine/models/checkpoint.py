"""Check a model directory without torch: config.json plus the safetensors headers.

`plan` and the pre-run checks use this (fast, no torch import); models/loader.py loads weights.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from batchrun.errors import ModelLoadError
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.models.quant import check_quantized_tensors
from batchrun.engine.safetensors_header import HeaderError, read_header

PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth",
                "model.ckpt", "tf_model.h5", "flax_model.msgpack")
# checkpoint tensors that are recomputed, not loaded
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# an image-text checkpoint's vision tower and projector (Gemma 3): prompts are text, never loaded
VISION = re.compile(r"^(model\.)?(vision_tower|vision_model|multi_modal_projector)\.")
# where an image-text checkpoint keeps its text tower: transformers 5.x saves
# model.language_model.*, the published 4.x checkpoints language_model.model.* (and
# language_model.lm_head)
_TEXT_TOWER = (("model.language_model.", "model."), ("language_model.model.", "model."),
               ("language_model.lm_head.", "lm_head."))


# Mixtral's published checkpoints: block_sparse_moe.{gate, experts.E.w1 (gate) / w3 (up) / w2
# (down)}; the canonical names are the Qwen MoE ones, mlp.{gate, experts.E.gate_proj/...}
_MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.\d+\.)(w[123])?"
                      r"(\.weight)?$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# transformers 5's in-memory (and fused-layout) names of the stacked experts
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def text_tower_name(name: str) -> str:
    """An image-text model's module or tensor name in its text tower as a causal LM's
    (model.layers.N...., lm_head...); other names as they are."""
    for old, new in _TEXT_TOWER:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def canonical_name(name: str, cfg: ModelConfig) -> str | None:
    """A checkpoint tensor's name as a causal LM's (model.layers.N...., lm_head.weight), or
    None for tensors that are not loaded (recomputed rotary tables, a vision tower)."""
    if IGNORED.match(name):
        return None
    m = _MIXTRAL.match(name) if cfg.experts is not None else None
    if m:
        layer, what, w, weight = m.groups()
        if w is None:
            return f"{layer}mlp.{what}{weight or ''}"
        return f"{layer}mlp.{what}{_MIXTRAL_EXPERT[w]}{weight or ''}"
    if cfg.weight_prefix != "model.":
        return None if VISION.match(name) else text_tower_name(name)
    return name


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files; refuses pickle-only checkpoints with a clear message."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: unreadable shard index ({e})") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: lists shard {f.name}, which is missing from {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [n for n in PICKLE_NAMES if (model_dir / n).exists()] + \
        [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt")]
    if pickles:
        raise ModelLoadError(
            f"{model_dir}: only pickle checkpoints found ({', '.join(sorted(set(pickles)))}); "
            f"batchrun loads safetensors only and never unpickles. Convert once with "
            f"transformers: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
            f"safe_serialization=True)")
    raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")


def expected_shapes(cfg: ModelConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Tensor name (canonical_name) -> shape, for every tensor the checkpoint must hold.
    fused_experts: the experts are stored stacked (transformers 5's mlp.experts.gate_up_proj
    [E, 2I, H] and down_proj [E, H, I]), not one gate/up/down_proj per expert."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    per_layer = {"self_attn.o_proj.weight": (h, q), "mlp.down_proj.weight": (h, i),
                 "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if cfg.fused_checkpoint:  # Phi-3 saves the projections we fuse already fused
        per_layer.update({"self_attn.qkv_proj.weight": (q + 2 * kv, h),
                          "mlp.gate_up_proj.weight": (2 * i, h)})
    else:
        per_layer.update({"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                          "self_attn.v_proj.weight": (kv, h), "mlp.gate_proj.weight": (i, h),
                          "mlp.up_proj.weight": (i, h)})
    if cfg.attention_bias:
        per_layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                          "self_attn.v_proj.bias": (kv,)})
    if cfg.o_proj_bias:
        per_layer["self_attn.o_proj.bias"] = (h,)
    if cfg.qk_norm:
        per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if cfg.sandwich_norms:
        per_layer.update({"pre_feedforward_layernorm.weight": (h,),
                          "post_feedforward_layernorm.weight": (h,)})
    moe = {} if cfg.experts is None else _expert_shapes(cfg, fused_experts)
    dense = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_up_proj.weight",
             "mlp.down_proj.weight")
    for n in range(cfg.num_hidden_layers):
        routed = cfg.is_moe_layer(n)
        for k, s in per_layer.items():
            if not (routed and k in dense):
                shapes[f"model.layers.{n}.{k}"] = s
        if routed:
            for k, s in moe.items():
                shapes[f"model.layers.{n}.{k}"] = s
    return shapes


def _expert_shapes(cfg: ModelConfig, fused: bool) -> dict[str, tuple[int, ...]]:
    h, e = cfg.hidden_size, cfg.experts
    i, n = e.intermediate_size, e.num_experts
    shapes = {"mlp.gate.weight": (n, h)}
    shared = e.shared_expert_intermediate_size
    if shared:
        shapes.update({"mlp.shared_expert.gate_proj.weight": (shared, h),
                       "mlp.shared_expert.up_proj.weight": (shared, h),
                       "mlp.shared_expert.down_proj.weight": (h, shared),
                       "mlp.shared_expert_gate.weight": (1, h)})
    if fused:
        shapes.update({FUSED_EXPERTS[0]: (n, 2 * i, h), FUSED_EXPERTS[1]: (n, h, i)})
        return shapes
    for x in range(n):
        shapes.update({f"mlp.experts.{x}.gate_proj.weight": (i, h),
                       f"mlp.experts.{x}.up_proj.weight": (i, h),
                       f"mlp.experts.{x}.down_proj.weight": (h, i)})
    return shapes


def _index_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    found = {}
    for f in files:
        try:
            for name, (dtype, shape) in read_header(f).items():
                found[name] = (f, shape, dtype)
        except (OSError, HeaderError) as e:  # corrupt header, truncated file
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from e
    return found


def check_checkpoint(model_dir: Path, cfg: ModelConfig) -> dict[str, tuple[Path, tuple, str]]:
    """Compare the checkpoint's tensor names and shapes (headers only) with the config.
    Returns canonical name -> (file, shape, the name in the file) of every tensor to load."""
    found = {}
    for stored, (f, shape, dtype) in _index_headers(safetensors_files(model_dir)).items():
        name = canonical_name(stored, cfg)
        if name is not None:
            found[name] = (f, shape, stored, dtype)
    want = expected_shapes(cfg, fused_experts=any(n.endswith(FUSED_EXPERTS[0]) for n in found))
    # an FP8 checkpoint's weights are e4m3 where its scheme says, with their scales beside them
    want = check_quantized_tensors(cfg.quant, want, found, str(model_dir / "config.json"))
    for name, (f, shape, _, _) in found.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: we use embed_tokens, an explicit copy is harmless
        if name not in want:
            raise ModelLoadError(f"{f}: unexpected tensor {name!r} (shape {list(shape)}) for a "
                                 f"{cfg.model_type} model; the checkpoint does not match config.json")
        allowed = want[name] if want[name] and isinstance(want[name][0], tuple) else (want[name],)
        if shape not in allowed:
            implied = " or ".join(str(list(a)) for a in allowed)
            raise ModelLoadError(f"{f}: tensor {name!r} has shape {list(shape)}, config.json "
                                 f"implies {implied}")
    missing = [n for n in want if n not in found]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{model_dir}: checkpoint is missing tensor(s) "
                             f"{', '.join(missing[:3])}{more}")
    return {name: (f, shape, stored) for name, (f, shape, stored, _) in found.items()}


def inspect_model(path: str | Path) -> ModelConfig:
    """Validate a model directory without loading weights (config + safetensors headers)."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory not found")
    cfg = ModelConfig.from_dir(model_dir)
    check_checkpoint(model_dir, cfg)
    return cfg


