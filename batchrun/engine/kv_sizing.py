"""How many KV blocks to allocate: from free GPU memory (gpu_memory_utilization) on CUDA, from a
fixed budget on CPU; never more than max_num_seqs full-length sequences need.

``max_num_seqs: auto`` (``resolve_max_num_seqs``): as many sequences as the budget holds at
max_model_len each (so a full batch never has to preempt), at least 1, at most
``AUTO_MAX_NUM_SEQS`` (256 on a GPU: past that a decode step is compute-bound and bigger
batches only add latency and graph memory; 16 on CPU, where a step's cost grows with the batch
and the cores are few). The budget is computed with the activation reserve of the cap, so the
resolved value never starves the blocks it was sized from.

``max_model_len: auto`` (``resolve_max_model_len``, before max_num_seqs): the model's context
(config.json max_position_embeddings), lowered to the longest sequence whose blocks the budget holds (a whole
number of blocks, one warning line saying so). That is resolved first because max_num_seqs auto
is counted in sequences of that length.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from batchrun.engine.config import AUTO_MAX_NUM_SEQS, EngineConfig
from batchrun.errors import ConfigError
from batchrun.engine.models import size
from batchrun.engine.models.config import ModelConfig

logger = logging.getLogger("batchrun.engine")


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: e4m3 for engine.kv_cache_dtype fp8, else the model dtype."""
    return torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else dtype


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    # dtype: the cache's (kv_cache_dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def activation_reserve(cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """Generous estimate of the peak activation memory of one step (prefill chunk or decode),
    plus a fixed margin for CUDA graph pools and allocator fragmentation."""
    elem = torch.empty((), dtype=dtype).element_size()
    t = max(config.max_num_batched_tokens, config.max_num_seqs)
    q = cfg.num_attention_heads * cfg.head_dim
    per_token = (4 * cfg.hidden_size + _mlp_activations(cfg) + 2 * q) * elem
    logits = config.max_num_seqs * cfg.vocab_size * 4 * 4  # fp32 logits, sort, softmax copies
    return 2 * t * per_token + logits + (1 << 30)


def _mlp_activations(cfg: ModelConfig) -> int:
    """Elements a token's widest MLP holds at once: gate_up and its activation (3 x
    intermediate) in a dense MLP; in an expert block, that for each of its top_k experts plus
    each expert's output before the weighted sum, the fp32 router logits (2 elements each), and
    a shared expert's gate_up and activation (Qwen2-MoE)."""
    n = cfg.num_hidden_layers
    dense = 3 * cfg.intermediate_size if any(not cfg.is_moe_layer(i) for i in range(n)) else 0
    e = cfg.experts
    if e is None:
        return dense
    routed = e.top_k * (3 * e.intermediate_size + cfg.hidden_size) + 2 * e.num_experts
    return max(dense, routed + 3 * e.shared_expert_intermediate_size)


def check_weights_fit(cfg: ModelConfig, config: EngineConfig, device: torch.device,
                      dtype: torch.dtype) -> None:
    """Before the weights load on a GPU: the weights (every expert of a mixture-of-experts
    model), one step's activations and one max_model_len sequence's KV must fit the memory
    engine.gpu_memory_utilization gives; else say by how much they do not."""
    if device.type != "cuda":
        return  # the CPU engine's weights live in host memory, outside the KV budget
    elem = torch.empty((), dtype=dtype).element_size()
    weights = size.num_params(cfg) * elem
    seqs = 1 if config.max_num_seqs == "auto" else config.max_num_seqs
    one = dataclasses.replace(config, max_num_seqs=seqs)
    blocks = 2 if config.max_model_len == "auto" else -(-config.max_model_len // config.block_size) + 1
    kv = blocks * bytes_per_block(cfg, config.block_size, dtype)
    need = weights + activation_reserve(cfg, one, dtype) + kv
    total = torch.cuda.mem_get_info(device)[1]
    budget = total * config.gpu_memory_utilization
    if need > budget:
        gib = 1 << 30
        experts = ("" if cfg.experts is None else
                   f" ({size.expert_params(cfg) * elem / gib:.1f} GiB of it experts)")
        raise ConfigError(
            f"engine: the model does not fit: its {size.num_params(cfg) / 1e9:.2f}B parameters take "
            f"{weights / gib:.1f} GiB in {str(dtype).removeprefix('torch.')}{experts}, and with one "
            f"step's activations and one sequence's KV cache it needs {need / gib:.1f} GiB, "
            f"{(need - budget) / gib:.1f} GiB more than the {budget / gib:.1f} GiB that "
            f"engine.gpu_memory_utilization={config.gpu_memory_utilization} gives of this GPU's "
            f"{total / gib:.1f} GiB; use a GPU with more memory, a smaller dtype or model")


def _budget_blocks(cfg: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> int:
    """KV blocks the memory budget holds (BATCHRUN_NUM_KV_BLOCKS when it is set), before any cap."""
    if config.experiments.num_kv_blocks is not None:
        return config.experiments.num_kv_blocks
    per_block = bytes_per_block(cfg, config.block_size, kv_cache_dtype(config, dtype))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = total * config.gpu_memory_utilization - (total - free) \
            - activation_reserve(cfg, config, dtype)
        return int(budget // per_block)
    return int(config.cpu_kv_cache_gb * (1 << 30) // per_block)


def resolve_max_model_len(cfg: ModelConfig, config: EngineConfig, device: torch.device,
                          dtype: torch.dtype) -> EngineConfig:
    """``config`` with an integer max_model_len: auto -> the model's context, or the longest
    multiple of block_size whose blocks the KV budget holds (besides the scratch block) when
    that is shorter; an integer stays as it is (num_kv_blocks refuses one that does not fit).
    Sized with the activation reserve max_num_seqs will have (auto: its cap), as
    resolve_max_num_seqs sizes it, so the two agree on the blocks."""
    if config.max_model_len != "auto":
        return config
    context = cfg.max_position_embeddings
    seqs = config.max_num_seqs
    if seqs == "auto":
        seqs = AUTO_MAX_NUM_SEQS["cuda" if device.type == "cuda" else "cpu"]
    usable = _budget_blocks(cfg, dataclasses.replace(config, max_num_seqs=seqs), device, dtype) - 1
    fit = usable * config.block_size
    if fit >= context:
        return dataclasses.replace(config, max_model_len=context)
    budget = ("BATCHRUN_NUM_KV_BLOCKS" if config.experiments.num_kv_blocks is not None else
              "engine.gpu_memory_utilization" if device.type == "cuda" else "engine.cpu_kv_cache_gb")
    if usable < 1:
        raise ConfigError(
            f"engine: the KV cache holds no block of {config.block_size} tokens besides its scratch "
            f"block, so no sequence fits (engine.max_model_len auto: the model's context is "
            f"{context}); give the cache more memory ({budget})")
    logger.warning(
        "batchrun: engine.max_model_len auto is %d, not the model's context %d: the KV cache "
        "(%s) holds %d tokens, one sequence of that length. Prompt + max_tokens longer than %d "
        "become error rows; raise %s for more, or set engine.max_model_len lower for more "
        "sequences at once", fit, context, budget, fit, fit, budget)
    return dataclasses.replace(config, max_model_len=fit)


def resolve_max_num_seqs(cfg: ModelConfig, config: EngineConfig, device: torch.device,
                         dtype: torch.dtype) -> EngineConfig:
    """``config`` with an integer max_num_seqs ("auto" sized as the module docstring says)."""
    if config.max_num_seqs != "auto":
        return config
    cap = AUTO_MAX_NUM_SEQS["cuda" if device.type == "cuda" else "cpu"]
    blocks = _budget_blocks(cfg, dataclasses.replace(config, max_num_seqs=cap), device, dtype)
    fit = (blocks - 1) // -(-config.max_model_len // config.block_size)  # -1: the scratch block
    return dataclasses.replace(config, max_num_seqs=max(1, min(cap, fit)))


def num_kv_blocks(cfg: ModelConfig, config: EngineConfig, device: torch.device,
                  dtype: torch.dtype) -> int:
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    cap = config.max_num_seqs * blocks_per_seq + 1  # +1: scratch block
    n = _budget_blocks(cfg, config, device, dtype)
    if config.experiments.num_kv_blocks is None:
        n = min(n, cap)
    if n - 1 < blocks_per_seq:
        have = max(n - 1, 0) * config.block_size
        raise ConfigError(
            f"engine: the KV cache holds {have} tokens but one sequence of max_model_len="
            f"{config.max_model_len} needs {blocks_per_seq * config.block_size}; lower "
            f"engine.max_model_len or give the cache more memory (gpu_memory_utilization, "
            f"cpu_kv_cache_gb{', or BATCHRUN_NUM_KV_BLOCKS' if config.experiments.num_kv_blocks else ''})")
    return n


def check_one_sequence_fits(cfg: ModelConfig, config: EngineConfig, device: torch.device,
                            dtype: torch.dtype) -> None:
    """Before the weights load: one max_model_len sequence's KV must fit the whole budget."""
    per_block = bytes_per_block(cfg, config.block_size, kv_cache_dtype(config, dtype))
    need = (-(-config.max_model_len // config.block_size) + 1) * per_block
    if device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[1] * config.gpu_memory_utilization
    else:
        budget = config.cpu_kv_cache_gb * (1 << 30)
    if config.experiments.num_kv_blocks is None and need > budget:
        raise ConfigError(
            f"engine: one sequence of max_model_len={config.max_model_len} needs {need / (1 << 30):.1f} GiB "
            f"of KV cache, more than the {budget / (1 << 30):.1f} GiB this device can give it; lower "
            "engine.max_model_len")
