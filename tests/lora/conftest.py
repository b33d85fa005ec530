"""Tiny real PEFT adapters on a tiny random transformers Llama (hidden 64, 2 layers, GQA)."""
import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (kernels under interpreter)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch import nn  # noqa: E402

from batchrun.engine.layers.linear import Linear  # noqa: E402
from batchrun.engine.models.config import ModelConfig  # noqa: E402

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)


def hf_config(**over):
    from transformers import LlamaConfig
    return LlamaConfig(**{**BASE, **over})


def model_config(**over) -> ModelConfig:
    raw = hf_config(**over).to_dict()
    raw["architectures"] = ["LlamaForCausalLM"]
    return ModelConfig.from_dict(raw)


def make_adapter(path, base_over=None, save_kwargs=None, seed=0, **lora_kwargs):
    """Save a PEFT LoRA adapter (random A and B) to `path`; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    base = LlamaForCausalLM(hf_config(**(base_over or {})))
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(str(path), **(save_kwargs or {}))
    return peft_model


def peft_deltas(peft_model) -> dict:
    """(layer, peft module) -> dense delta weight [out, in] (peft's own get_delta_weight)."""
    from peft.tuners.lora import LoraLayer
    out = {}
    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            out[(layer, parts[-1])] = mod.get_delta_weight("default").detach().float()
    return out


class FakeLlama(nn.Module):
    """The module tree of batchrun's LlamaForCausalLM (just the Linears), random weights."""

    def __init__(self, cfg: ModelConfig, dtype=torch.float32, seed=0):
        super().__init__()
        self.config = cfg
        g = torch.Generator().manual_seed(seed)
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            layer = nn.Module()
            layer.self_attn, layer.mlp = nn.Module(), nn.Module()
            layer.self_attn.qkv_proj = Linear(H, [q, kv, kv], name="qkv_proj")
            layer.self_attn.o_proj = Linear(q, [H], name="o_proj")
            layer.mlp.gate_up_proj = Linear(H, [I, I], name="gate_up_proj")
            layer.mlp.down_proj = Linear(I, [H], name="down_proj")
            self.model.layers.append(layer)
        for p in self.parameters():
            p.data = (torch.randn(p.shape, generator=g) * 0.1).to(dtype)


@pytest.fixture
def mcfg():
    return model_config()
