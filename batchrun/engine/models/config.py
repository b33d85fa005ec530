"""ModelConfig: what the shared decoder (models/decoder.py) needs from a Hugging Face config.json.

One decoder runs every family; a family is a handful of fields here (norm offset, activation,
q/k norms, the extra Gemma norms, embedding scale, attention scale and soft-caps, per-layer
attention windows, local rope, partial rotary, fused checkpoint names), never a copy of the
model. Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) are the same decoder with a routed
expert block in place of the MLP on the layers that have one (`Experts`). Reads both
transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`)
layouts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.errors import ModelLoadError
from batchrun.engine.models.quant import MOE_FP8, QuantScheme, scheme_from_config

# architecture -> model_type (the family)
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text tower (text_config)
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn", "longrope")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_GEMMA = ("gemma2", "gemma3_text")
_MOE = ("mixtral", "qwen3_moe", "qwen2_moe")
FULL, SLIDING = "full_attention", "sliding_attention"

# What transformers' config class of each family sets for a field config.json leaves out
# (transformers 5.17; tests/engine/test_rope_config.py checks them against the installed
# release). save_pretrained writes every field, so these matter for hand-written or trimmed
# configs: without them a Gemma config without hidden_activation ran SiLU, and a Gemma 3 one
# without a rope theta the generic 10000 on its global layers.
_SIZES = dict(rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
_QWEN = dict(rms_norm_eps=1e-6, max_position_embeddings=32768, bos_token_id=None, eos_token_id=None)
_GEMMA_DEFAULTS = dict(hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                       tie_word_embeddings=True, sliding_window=4096, head_dim=256,
                       query_pre_attn_scalar=256, num_key_value_heads=4, bos_token_id=2,
                       eos_token_id=1)
FAMILY_DEFAULTS = {
    "llama": dict(_SIZES, max_position_embeddings=2048),
    "mistral": dict(_SIZES, max_position_embeddings=131072, sliding_window=4096,
                    num_key_value_heads=8),
    "qwen2": dict(_QWEN, num_key_value_heads=32),
    "qwen3": dict(_QWEN, num_key_value_heads=32, head_dim=128),
    "gemma2": dict(_GEMMA_DEFAULTS, max_position_embeddings=8192, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(_GEMMA_DEFAULTS, max_position_embeddings=131072, rope_theta=1e6,
                        rope_local_base_freq=10000.0),
    "phi3": dict(rms_norm_eps=1e-5, max_position_embeddings=4096,
                 original_max_position_embeddings=4096, bos_token_id=1, eos_token_id=32000),
    "mixtral": dict(_SIZES, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=1e6,
                    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(_QWEN, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768),
    "qwen2_moe": dict(_QWEN, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
                      moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
}


@dataclass(frozen=True)
class Rope:
    """One rotary table's parameters: base, scaling (None = default rope) and rotated dims."""
    theta: float
    scaling: dict | None  # {"rope_type": "llama3" | "linear" | "yarn" | "longrope", ...}
    rotary_dim: int


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts block: the router picks `top_k` of `num_experts` gated MLPs (each of
    `intermediate_size`) per token, softmax over all experts in fp32, then the top k."""
    num_experts: int
    top_k: int
    intermediate_size: int
    # divide the top-k probabilities by their sum (Mixtral always; Qwen3-MoE per norm_topk_prob)
    norm_topk_prob: bool
    # round the top-k weights to the model's dtype before they scale the experts' outputs (the
    # Qwen MoE routers do; Mixtral's keeps them in fp32)
    round_weights: bool
    # the layers that run a dense MLP of the model's intermediate_size instead (Qwen3-MoE's
    # mlp_only_layers, and the layers decoder_sparse_step skips)
    dense_layers: tuple[int, ...] = ()
    # Qwen2-MoE: a dense MLP of this width beside the routed experts, its output scaled by
    # sigmoid(shared_expert_gate(x)) and added (0: none)
    shared_expert_intermediate_size: int = 0


@dataclass
class ModelConfig:
    model_type: str  # the family: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3,
    # mixtral, qwen2_moe, qwen3_moe
    architectures: list[str]
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None = default rope; {"rope_type": "llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v bias (Qwen2 always; others per attention_bias)
    sliding_window: int | None  # the window of the layers whose layer_types entry is sliding
    torch_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # --- what distinguishes the families (defaults: Llama) ---
    hidden_act: str = "silu"  # "silu" | "gelu_tanh": the gated MLP's act(gate) * up
    norm_offset: float = 0.0  # 1.0: Gemma's RMSNorm scales by (1 + weight)
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotary (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma: norms after attention and MLP, before the residual add
    o_proj_bias: bool = False
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float | None = None  # Gemma 2
    final_logit_softcap: float | None = None  # Gemma 2
    layer_types: list[str] = field(default_factory=list)  # FULL or SLIDING per layer
    local_rope: Rope | None = None  # the sliding layers' rope when it differs (Gemma 3)
    partial_rotary_factor: float = 1.0  # Phi-4-mini: rotary on the first 75 % of head_dim
    fused_checkpoint: bool = False  # Phi-3: the checkpoint holds qkv_proj and gate_up_proj
    weight_prefix: str = "model."  # where the decoder's tensors sit in the checkpoint
    # FP8 linear layers (models/quant.py): the checkpoint's scheme, or the on-the-fly one the
    # engine sets for engine.quantization: fp8; None = the model dtype throughout
    quant: QuantScheme | None = None
    experts: Experts | None = None  # None: every layer's MLP is dense

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs the routed experts (else the dense MLP)."""
        return self.experts is not None and layer not in self.experts.dense_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope(self) -> Rope:
        """The rope of full-attention layers (and of every layer without local_rope)."""
        return Rope(self.rope_theta, self.rope_scaling, self.rotary_dim)

    def layer_rope(self, layer: int) -> Rope:
        if self.local_rope is not None and self.layer_types[layer] == SLIDING:
            return self.local_rope
        return self.rope

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: full causal attention)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{cfg_path}: not found; a model directory needs a Hugging Face "
                                 f"config.json (save the model with save_pretrained)")
        try:
            raw = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{cfg_path}: cannot read JSON ({e})") from e
        return cls.from_dict(raw, str(cfg_path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        known = [a for a in archs if a in SUPPORTED]
        if not known and model_type not in SUPPORTED.values():
            raise ModelLoadError(
                f"{where}: unsupported architecture {archs or model_type!r}; batchrun runs "
                f"{', '.join(SUPPORTED)}")
        if known:
            model_type = SUPPORTED[known[0]]
        if raw.get("auto_map"):
            # we never execute repository code; a config that needs it describes a custom model
            raise ModelLoadError(f"{where}: 'auto_map' asks for custom model code, which batchrun "
                                 f"never executes; use a standard {', '.join(SUPPORTED)} checkpoint")
        quant = raw.get("quantization_config")
        quant = None if quant is None else scheme_from_config(quant, where)
        if quant is not None and model_type in _MOE:
            raise ModelLoadError(f"{where}: {MOE_FP8}")
        prefix = "model."
        if model_type == "gemma3":  # image-text checkpoint: run its text tower on text prompts
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ModelLoadError(f"{where}: Gemma3ForConditionalGeneration without a "
                                     f"text_config object")
            # the whole model's fields win (transformers ties lm_head by the top-level flag)
            raw = {**text, **{k: raw[k] for k in ("eos_token_id", "bos_token_id", "torch_dtype",
                                                  "dtype", "tie_word_embeddings") if k in raw}}
            model_type, prefix = "gemma3_text", "model.language_model."
        raw = {**FAMILY_DEFAULTS[model_type], **raw}
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"{where}: activation {act!r} is not supported "
                                 f"({', '.join(_ACTIVATIONS)})")
        if raw.get("mlp_bias"):
            raise ModelLoadError(f"{where}: mlp_bias=true is not supported")
        if raw.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{where}: use_bidirectional_attention=true describes an encoder "
                                 f"(embedding model), not a causal language model")
        for k in ("num_attention_heads", "hidden_size", "vocab_size", "intermediate_size",
                  "num_hidden_layers"):
            if raw.get(k) is None:
                raise ModelLoadError(f"{where}: missing {k}")
        heads, layers = raw["num_attention_heads"], raw["num_hidden_layers"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        gemma = model_type in _GEMMA
        rope, local_rope = _ropes(raw, model_type, head_dim, where)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window, layer_types = _windows(raw, model_type, layers, where)
        bias = bool(raw.get("attention_bias", False))
        if model_type == "qwen2_moe":  # q/k/v bias under its own name (o_proj has none)
            bias = bool(raw.get("qkv_bias", True))
        scalar = raw.get("query_pre_attn_scalar") if gemma else None
        return cls(
            model_type=model_type,
            architectures=list(archs),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
            attention_bias=model_type == "qwen2" or bias,
            sliding_window=window,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            hidden_act=_ACTIVATIONS[act],
            norm_offset=1.0 if gemma else 0.0,
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            sandwich_norms=gemma,
            o_proj_bias=bias and model_type not in ("qwen2", "qwen2_moe"),
            embed_scale=raw["hidden_size"] ** 0.5 if gemma else None,
            attn_scale=None if scalar is None else float(scalar) ** -0.5,
            attn_logit_softcap=raw.get("attn_logit_softcapping") if gemma else None,
            final_logit_softcap=raw.get("final_logit_softcapping") if gemma else None,
            layer_types=layer_types,
            local_rope=local_rope,
            partial_rotary_factor=rope.rotary_dim / head_dim,
            fused_checkpoint=model_type == "phi3",
            weight_prefix=prefix,
            quant=quant,
            experts=_experts(raw, model_type, layers, where) if model_type in _MOE else None,
        )


def _positive_int(raw: dict, keys: tuple[str, ...], where: str, default=None) -> int:
    """The first of `keys` present in `raw` (transformers has saved the same field under
    different names), which must be an integer >= 1."""
    key = next((k for k in keys if raw.get(k) is not None), keys[0])
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def _experts(raw: dict, model_type: str, layers: int, where: str) -> Experts:
    """The expert block of a Mixtral, Qwen2-MoE or Qwen3-MoE config, as transformers 5.17
    builds it."""
    # Qwen3MoeConfig maps num_experts onto num_local_experts when it saves
    experts = _positive_int(raw, ("num_local_experts", "num_experts"), where)
    top_k = _positive_int(raw, ("num_experts_per_tok",), where)
    if top_k > experts:
        raise ModelLoadError(f"{where}: num_experts_per_tok {top_k} is more than the "
                             f"{experts} experts")
    if model_type == "mixtral":  # every layer routed; the experts are intermediate_size wide
        return Experts(experts, top_k, raw["intermediate_size"], norm_topk_prob=True,
                       round_weights=False)
    step = _positive_int(raw, ("decoder_sparse_step",), where, default=1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(not isinstance(i, int) for i in only):
        raise ModelLoadError(f"{where}: mlp_only_layers must be a list of layer indices, "
                             f"got {only!r}")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = 0
    if model_type == "qwen2_moe":
        shared = _positive_int(raw, ("shared_expert_intermediate_size",), where)
    return Experts(experts, top_k, _positive_int(raw, ("moe_intermediate_size",), where),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)), round_weights=True,
                   dense_layers=dense, shared_expert_intermediate_size=shared)


def _windows(raw: dict, model_type: str, layers: int, where: str) -> tuple[int | None, list[str]]:
    """(window, per-layer FULL/SLIDING) as transformers derives them for each family."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not raw.get("use_sliding_window"):
        window = None  # transformers sets it to None too
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"{where}: sliding_window must be a positive integer, got {window!r}")
    types = raw.get("layer_types")
    if types is None:
        if model_type == "qwen2_moe":  # what Qwen2MoeConfig writes into layer_types
            first = raw.get("max_window_layers", 28)
            types = [SLIDING if window is not None and (i + 1) % 2 and i < first else FULL
                     for i in range(layers)]
        elif model_type in ("qwen2", "qwen3"):
            first = raw.get("max_window_layers", 28)
            types = [SLIDING if window is not None and i >= first else FULL for i in range(layers)]
        elif model_type in _GEMMA:  # every pattern-th layer global: Gemma 2 alternates, Gemma 3 1 in 6
            pattern = 2 if model_type == "gemma2" else raw.get("sliding_window_pattern", 6)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
        else:  # Mistral, Phi-3, Mixtral, Qwen3-MoE (and Llama, which has no window): one window
            # for every layer
            types = [SLIDING if window is not None else FULL] * layers
    if len(types) != layers or any(t not in (FULL, SLIDING) for t in types):
        raise ModelLoadError(f"{where}: layer_types must list {layers} entries of "
                             f"{FULL!r} or {SLIDING!r}, got {types!r}")
    if model_type == "llama" and SLIDING in types:
        raise ModelLoadError(f"{where}: a Llama config with sliding-window layers is not a "
                             f"model transformers runs as LlamaForCausalLM")
    if window is None:
        types = [FULL] * layers
    return window, list(types)


def _ropes(raw: dict, model_type: str, head_dim: int, where: str) -> tuple[Rope, Rope | None]:
    """The rope of full-attention layers, and Gemma 3's separate one for sliding layers."""
    params = raw.get("rope_parameters")
    if model_type == "gemma3_text":
        if isinstance(params, dict) and FULL in params:  # 5.x: one entry per layer type
            full = _rope(raw, params[FULL], head_dim, where)
            local = _rope(raw, params.get(SLIDING) or {"rope_theta": 10000.0}, head_dim, where)
        else:  # 4.x: rope_theta (+ rope_scaling) global, rope_local_base_freq local
            full = _rope(raw, _params_4x(raw), head_dim, where)
            local = _rope(raw, {"rope_theta": raw.get("rope_local_base_freq", 10000.0)},
                          head_dim, where)
        return full, local
    return _rope(raw, params if params is not None else _params_4x(raw), head_dim, where), None


def _params_4x(raw: dict) -> dict:
    params = dict(raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in raw:
        params.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    return params


def _rope(raw: dict, params: dict, head_dim: int, where: str) -> Rope:
    params = dict(params)
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ModelLoadError(f"{where}: partial_rotary_factor {partial} gives {rotary_dim} rotary "
                             f"dimensions of head_dim {head_dim}; it must be even and > 0")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    max_pos = raw.get("max_position_embeddings", 2048)
    # the pretraining length: the top-level field when the checkpoint has one (Phi-3), else
    # the scaling's, else max_position_embeddings (as transformers reads it)
    original = raw.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", max_pos))

    def factor(required: bool = True) -> float:
        f = params.get("factor")
        if f is None and not required:
            return max_pos / original
        if not isinstance(f, (int, float)) or isinstance(f, bool) or f <= 0:
            raise ModelLoadError(f"{where}: rope scaling type {rope_type} needs a positive "
                                 f"'factor', got {f!r}")
        return float(f)

    if rope_type == "default":
        return Rope(theta, None, rotary_dim)
    if rope_type == "dynamic":
        # transformers rescales only once a sequence is longer than max_position_embeddings,
        # which engine.max_model_len never allows: the frequencies are the default ones
        factor()
        return Rope(theta, None, rotary_dim)
    if rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in params:
                raise ModelLoadError(f"{where}: rope_scaling type llama3 needs {k!r}")
        return Rope(theta, {"rope_type": "llama3", **params}, rotary_dim)
    if rope_type == "linear":
        return Rope(theta, {"rope_type": "linear", "factor": factor()}, rotary_dim)
    if rope_type == "yarn":
        # factor defaults to the ratio of the two lengths
        return Rope(theta, {"rope_type": "yarn", "factor": factor(required=False),
                            "original_max_position_embeddings": int(original),
                            **{k: params[k] for k in ("attention_factor", "mscale", "mscale_all_dim",
                                                      "beta_fast", "beta_slow", "truncate")
                               if k in params}}, rotary_dim)
    if rope_type == "longrope":
        for k in ("short_factor", "long_factor"):
            f = params.get(k)
            if not isinstance(f, list) or len(f) != rotary_dim // 2:
                raise ModelLoadError(f"{where}: rope scaling longrope needs {k!r}, a list of "
                                     f"{rotary_dim // 2} numbers (rotary_dim / 2)")
        return Rope(theta, {"rope_type": "longrope", "factor": factor(required=False),
                            "original_max_position_embeddings": int(original),
                            "short_factor": [float(x) for x in params["short_factor"]],
                            "long_factor": [float(x) for x in params["long_factor"]],
                            **({"attention_factor": params["attention_factor"]}
                               if params.get("attention_factor") is not None else {})}, rotary_dim)
    raise ModelLoadError(f"{where}: rope scaling type {rope_type!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")


def check_context_length(cfg: ModelConfig, max_model_len: int, model_dir: str) -> None:
    """engine.max_model_len must fit the model's context (checked before any table is built)."""
    from batchrun.errors import ConfigError
    if max_model_len > cfg.max_position_embeddings:
        raise ConfigError(f"engine.max_model_len: {max_model_len} is longer than the model's context "
                          f"(max_position_embeddings {cfg.max_position_embeddings} in {model_dir}/config.json); "
                          f"set engine.max_model_len <= {cfg.max_position_embeddings}")
