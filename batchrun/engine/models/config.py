"""ModelConfig: the subset of a Hugging Face config.json that our Llama-family model needs.

Reads both transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) layouts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from batchrun.errors import ModelLoadError

# architectures we implement -> model_type
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    model_type: str
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
    attention_bias: bool  # q/k/v bias (Qwen2 always)
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

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
                f"{', '.join(SUPPORTED)} (decoder-only Llama family)")
        if known:
            model_type = SUPPORTED[known[0]]
        if raw.get("auto_map"):
            # we never execute repository code; a config that needs it describes a custom model
            raise ModelLoadError(f"{where}: 'auto_map' asks for custom model code, which batchrun "
                                 f"never executes; use a standard {', '.join(SUPPORTED)} checkpoint")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("mlp_bias"):
            raise ModelLoadError(f"{where}: mlp_bias=true is not supported")
        if raw.get("num_attention_heads") is None or raw.get("hidden_size") is None:
            raise ModelLoadError(f"{where}: missing hidden_size or num_attention_heads")
        heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _rope(raw, where)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = None
        if model_type == "mistral":
            window = raw.get("sliding_window")
        elif model_type == "qwen2" and raw.get("use_sliding_window"):
            window = raw.get("sliding_window")
        return cls(
            model_type=model_type,
            architectures=list(archs),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_window=window,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )


def _rope(raw: dict, where: str) -> tuple[float, dict | None]:
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4.x layout
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params = dict(params)
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in params:
                raise ModelLoadError(f"{where}: rope_scaling type llama3 needs {k!r}")
        return theta, {"rope_type": "llama3", **params}
    if rope_type == "linear":
        if not isinstance(params.get("factor"), (int, float)) or params["factor"] <= 0:
            raise ModelLoadError(f"{where}: rope_scaling type linear needs a positive 'factor', "
                                 f"got {params.get('factor')!r}")
        return theta, {"rope_type": "linear", "factor": float(params["factor"])}
    if rope_type == "yarn":
        # as transformers: the pretraining length from the top-level field when the checkpoint
        # has one (Phi-3 style), else rope_scaling's, else max_position_embeddings; factor
        # defaults to the ratio of the two lengths
        max_pos = raw.get("max_position_embeddings", 2048)
        original = raw.get("original_max_position_embeddings",
                           params.get("original_max_position_embeddings", max_pos))
        factor = params.get("factor") or max_pos / original
        return theta, {"rope_type": "yarn", "factor": float(factor),
                       "original_max_position_embeddings": int(original),
                       **{k: params[k] for k in ("attention_factor", "mscale", "mscale_all_dim",
                                                 "beta_fast", "beta_slow", "truncate") if k in params}}
    raise ModelLoadError(f"{where}: rope scaling type {rope_type!r} is not supported "
                         f"(supported: default, llama3, linear, yarn)")


def check_context_length(cfg: ModelConfig, max_model_len: int, model_dir: str) -> None:
    """engine.max_model_len must fit the model's context (checked before any table is built)."""
    from batchrun.errors import ConfigError
    if max_model_len > cfg.max_position_embeddings:
        raise ConfigError(f"engine.max_model_len: {max_model_len} is longer than the model's context "
                          f"(max_position_embeddings {cfg.max_position_embeddings} in {model_dir}/config.json); "
                          f"set engine.max_model_len <= {cfg.max_position_embeddings}")
