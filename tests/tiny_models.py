"""Tiny random Hugging Face models saved with save_pretrained, for parity tests (CPU, fp32)."""
from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=211, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

VARIANTS = {
    "llama_mha": dict(arch="llama", num_key_value_heads=4),
    "llama3_gqa": dict(arch="llama", num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0),
    "llama_tied": dict(arch="llama", num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2_bias": dict(arch="qwen2", num_key_value_heads=2),
    "mistral": dict(arch="mistral", num_key_value_heads=2, sliding_window=None, head_dim=16),
}


def make_hf_model(variant: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, \
        Qwen2Config, Qwen2ForCausalLM
    kw = dict(BASE)
    kw.update(VARIANTS[variant])
    arch = kw.pop("arch")
    cls_cfg, cls_model = {"llama": (LlamaConfig, LlamaForCausalLM),
                          "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "mistral": (MistralConfig, MistralForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kw)).float().eval()
    # random init has tiny weights -> near-uniform logits; scale up so greedy choices are clear
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    return model


def save_hf_model(variant: str, path: Path, seed: int = 0, **save_kw):
    model = make_hf_model(variant, seed)
    model.save_pretrained(str(path), **save_kw)
    return model


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """HF generate, greedy, one row at a time (no padding effects); returns new tokens."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def save_peft_adapters(root: Path, names: list[str], variant: str = "llama3_gqa", seed: int = 0,
                       rank: int = 4, targets=("q_proj", "v_proj"), scale: float = 0.15) -> dict[str, str]:
    """Random PEFT LoRA adapters (non-zero A and B: init_lora_weights=False, then N(0, scale)
    from seed + i) for the tiny `variant`, saved under root/<name>. Returns {name: path}."""
    from peft import LoraConfig, get_peft_model
    adapters = {}
    for i, name in enumerate(names):
        model = get_peft_model(make_hf_model(variant),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                          init_lora_weights=False))
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
        model.save_pretrained(str(root / name))
        adapters[name] = str(root / name)
    return adapters
