"""How many parameters a model of a ModelConfig holds, from the config alone (no weights):
what the memory check before loading (kv_sizing.check_weights_fit) and the benchmark presets
count. A mixture-of-experts layer holds all its experts; a token reads only top_k of them
(`active_params`)."""
from __future__ import annotations

from batchrun.engine.models.config import ModelConfig


def _attention_and_norms(cfg: ModelConfig) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    n = h * (q + 2 * kv) + q * h + (4 if cfg.sandwich_norms else 2) * h
    n += (q + 2 * kv if cfg.attention_bias else 0) + (h if cfg.o_proj_bias else 0)
    return n + (2 * d if cfg.qk_norm else 0)


def _mlp(cfg: ModelConfig, layer: int, experts_read: int | None) -> int:
    """Parameters of layer `layer`'s MLP or expert block; experts_read: how many experts count
    (None: all of them)."""
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 3 * h * cfg.intermediate_size
    e = cfg.experts
    n = e.num_experts if experts_read is None else experts_read
    shared = 3 * h * e.shared_expert_intermediate_size + h if e.shared_expert_intermediate_size else 0
    return e.num_experts * h + n * 3 * h * e.intermediate_size + shared  # router, experts, shared


def _total(cfg: ModelConfig, experts_read: int | None) -> int:
    h = cfg.hidden_size
    layers = sum(_attention_and_norms(cfg) + _mlp(cfg, i, experts_read)
                 for i in range(cfg.num_hidden_layers))
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + layers + h + head


def num_params(cfg: ModelConfig) -> int:
    """Every parameter of the model (each expert of every routed layer)."""
    return _total(cfg, None)


def active_params(cfg: ModelConfig) -> int:
    """The parameters one token's forward pass reads: top_k experts of each routed layer (the
    whole model for a dense one)."""
    return _total(cfg, None if cfg.experts is None else cfg.experts.top_k)


def expert_params(cfg: ModelConfig) -> int:
    """The parameters of every expert of every routed layer (0 for a dense model)."""
    e = cfg.experts
    if e is None:
        return 0
    routed = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return routed * e.num_experts * 3 * cfg.hidden_size * e.intermediate_size
