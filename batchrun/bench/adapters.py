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

from batchrun.engine.lora.adapters import module_shapes
from batchrun.engine.lora.peft_config import module_key, peft_modules
from batchrun.engine.models.config import ModelConfig


def write_random_adapter(path: str | Path, cfg: ModelConfig, rank: int, *, seed: int = 0,
                         base_model: str = "random", std: float = 0.01,
                         dtype: torch.dtype = torch.bfloat16) -> Path:
    """adapter_config.json + adapter_model.safetensors with lora_A [r, in], lora_B [out, r]
    ~ N(0, std) for every Linear of every layer (a routed layer's: its attention's), named as
    the family's transformers class
    names them (q/k/v/o/gate/up/down_proj; Phi-3: qkv/o/gate_up/down_proj); lora_alpha = 2r
    (scaling 2)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    modules, shapes = peft_modules(cfg), module_shapes(cfg)
    if cfg.experts is not None and all(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        # every layer routed: no dense MLP Linear to target (expert LoRA is not written here)
        modules = {p: m for p, m in modules.items() if m[0] != "mlp"}
    for layer in range(cfg.num_hidden_layers):
        for proj in modules:
            if modules[proj][0] == "mlp" and cfg.is_moe_layer(layer):
                continue  # a routed layer has no dense MLP
            fan_in, fan_out = shapes[proj]
            prefix = f"base_model.model.{module_key(layer, proj)}"
            tensors[f"{prefix}.lora_A.weight"] = \
                (torch.randn(rank, fan_in, generator=gen) * std).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = \
                (torch.randn(fan_out, rank, generator=gen) * std).to(dtype)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
              "target_modules": list(modules), "bias": "none", "task_type": "CAUSAL_LM",
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
