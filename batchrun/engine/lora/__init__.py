"""PEFT LoRA adapters: validation/loading (adapters), GPU slots (manager), Linear hook (layer)."""
from batchrun.engine.lora.adapters import AdapterInfo, LoRATarget, LoRAWeights, inspect_adapter, load_adapter

__all__ = ["AdapterInfo", "LoRATarget", "LoRAWeights", "inspect_adapter", "load_adapter"]
