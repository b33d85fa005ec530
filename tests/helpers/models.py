"""The one tiny-model factory: random Hugging Face models in a few named shapes, built and saved
with transformers (CPU, fp32).

A shape is (architecture, config, weight init). ``init_std`` redraws every matrix N(0, init_std)
and every bias N(0, bias_std) after transformers' own init, because that init has tiny weights and
near-uniform logits, and greedy parity tests need clear choices; ``init_std=None`` keeps
transformers' init. The same (shape, seed, overrides) always gives the same weights.
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.tokenizer import CHARS, SPECIALS

# the parity shapes: hidden 64, 2 layers, 4 heads
_PARITY = dict(vocab_size=211, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
_SCALED = dict(init_std=0.08, bias_std=0.05)

SHAPES = {
    "llama_mha": dict(arch="llama", **_PARITY, num_key_value_heads=4, **_SCALED),
    "llama3_gqa": dict(arch="llama", **_PARITY, num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0, **_SCALED),
    "llama_tied": dict(arch="llama", **_PARITY, num_key_value_heads=2, tie_word_embeddings=True, **_SCALED),
    # rope scalings whose pretraining length (64) the parity prompts (up to 200 + 40) run past
    "llama_linear_rope": dict(arch="llama", **_PARITY, num_key_value_heads=2,
                              rope_scaling={"rope_type": "linear", "factor": 4.0}, **_SCALED),
    "qwen2_yarn": dict(arch="qwen2", **_PARITY, num_key_value_heads=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, **_SCALED),
    "qwen2_bias": dict(arch="qwen2", **_PARITY, num_key_value_heads=2, **_SCALED),
    "mistral": dict(arch="mistral", **_PARITY, num_key_value_heads=2, sliding_window=None, head_dim=16,
                    **_SCALED),
    # the job-side tests' model: one layer over the character vocabulary of tests.helpers.tokenizer
    # (one id per special and character), transformers' init
    "char_llama": dict(arch="llama", vocab_size=len(SPECIALS) + len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0, init_std=None),
    # the LoRA-loading tests' base (GQA, 2 layers), transformers' init
    "lora_llama": dict(arch="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                       init_std=None),
}
# the shapes every engine-vs-transformers parity test runs over
VARIANTS = {name: SHAPES[name] for name in ("llama_mha", "llama3_gqa", "llama_tied", "qwen2_bias", "mistral",
                                             "llama_linear_rope", "qwen2_yarn")}


def _split(variant: str, over: dict) -> tuple[str, dict, dict]:
    kw = {**SHAPES[variant], **over}
    init = {"init_std": kw.pop("init_std", None), "bias_std": kw.pop("bias_std", 0.0)}
    return kw.pop("arch"), kw, init


def hf_config(variant: str, **over):
    """The transformers config of shape ``variant`` with ``over`` applied."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    over = {k: v for k, v in over.items() if k not in ("init_std", "bias_std")}
    arch, kw, _ = _split(variant, over)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch](**kw)


def make_hf_model(variant: str, seed: int = 0, **over):
    """A random transformers model of shape ``variant`` (eval, fp32). ``over``: config fields, or
    ``init_std``/``bias_std`` (None: transformers' init)."""
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
    arch, _, init = _split(variant, over)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "mistral": MistralForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(hf_config(variant, **over)).float().eval()
    if init["init_std"] is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, init["init_std"])
                elif "bias" in name:
                    p.normal_(0.0, init["bias_std"])
    return model


def save_hf_model(variant: str, path: Path, seed: int = 0, tokenizer=None, over: dict | None = None, **save_kw):
    """make_hf_model(variant, seed, **over) saved to ``path`` (save_pretrained(**save_kw)), with
    ``tokenizer`` beside it if given."""
    model = make_hf_model(variant, seed, **(over or {}))
    model.save_pretrained(str(path), **save_kw)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return model


def model_config(variant: str = "lora_llama", **over):
    """batchrun's ModelConfig of shape ``variant`` (as the loader reads config.json)."""
    from batchrun.engine.models.config import ModelConfig
    raw = hf_config(variant, **over).to_dict()
    raw["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "mistral": "MistralForCausalLM"}[SHAPES[variant]["arch"]]]
    return ModelConfig.from_dict(raw)


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
