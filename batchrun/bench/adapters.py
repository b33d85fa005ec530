"""Random PEFT LoRA adapters for benchmarks, written in peft's on-disk format.

They are loaded through the engine's normal path (adapters={name: dir}), so a benchmark pays
exactly what a real adapter costs. B is random, not zero as at peft's initialisation: a zero B
would make every LoRA delta vanish and hide a broken LoRA path behind identical outputs.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchrun.engine.models.config import ModelConfig

# peft module -> parent in the decoder layer (all 7 Linear projections of a Llama layer)
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _in_out(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_random_adapter(path: str | Path, cfg: ModelConfig, rank: int, *, seed: int = 0,
                         base_model: str = "random", std: float = 0.01,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """adapter_config.json + adapter_model.safetensors with lora_A [r, in], lora_B [out, r]
    ~ N(0, std) for all 7 projections of every layer; lora_alpha = 2r (scaling 2)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (fan_in, fan_out) in _in_out(cfg).items():
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[proj]}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = \
                (torch.randn(rank, fan_in, generator=gen) * std).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = \
                (torch.randn(fan_out, rank, generator=gen) * std).to(dtype)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": list(TARGETS), "bias": "none", "task_type": "CAUSAL_LM",
              "base_model_name_or_path": base_model, "use_rslora": False, "use_dora": False}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def write_random_adapters(root: str | Path, cfg: ModelConfig, count: int, rank: int, *,
                          seed: int = 0, base_model: str = "random",
                          std: float = 0.01) -> dict[str, str]:
    """`count` adapters lora0..lora{count-1} under root, different seeds; name -> directory."""
    root = Path(root)
    return {f"lora{i}": str(write_random_adapter(root / f"lora{i}", cfg, rank, seed=seed + 1 + i,
                                                 base_model=base_model, std=std))
            for i in range(count)}
