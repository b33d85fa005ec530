"""The one tiny-model factory: random Hugging Face models in a few named shapes, built and saved
with transformers (CPU, fp32).

A shape is (architecture, config, weight init). ``init_std`` redraws every matrix (and stacked
expert weights) N(0, init_std)
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
# the families with norms beyond Llama's (q/k norms, Gemma's four): every norm weight perturbed too,
# so a norm applied wrongly (offset, order, missing) changes the greedy tokens
_NORMS = dict(_SCALED, norm_std=0.2)
_WINDOW = 48  # shorter than the longer parity prompts (200 + 40), not a multiple of 16

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
    "mistral_window": dict(arch="mistral", **_PARITY, num_key_value_heads=2, sliding_window=_WINDOW,
                           **_SCALED),
    # Qwen2's window on the layers from max_window_layers on (here the second)
    "qwen2_window": dict(arch="qwen2", **_PARITY, num_key_value_heads=2, use_sliding_window=True,
                         sliding_window=_WINDOW, max_window_layers=1, **_SCALED),
    "llama_dynamic_rope": dict(arch="llama", **_PARITY, num_key_value_heads=2,
                               rope_scaling={"rope_type": "dynamic", "factor": 2.0}, **_SCALED),
    # Qwen3: q/k norms, head_dim 32 != hidden / heads
    "qwen3": dict(arch="qwen3", **_PARITY, num_key_value_heads=2, head_dim=32, **_NORMS),
    "qwen3_tied_window": dict(arch="qwen3", **_PARITY, num_key_value_heads=1, head_dim=16,
                              tie_word_embeddings=True, use_sliding_window=True,
                              sliding_window=_WINDOW, max_window_layers=1, **_NORMS),
    # Gemma 2: (1 + w) norms, four per layer, GeGLU, scaled embeddings, query_pre_attn_scalar,
    # both soft-caps (small enough to bite), a window on the first layer
    "gemma2": dict(arch="gemma2", **_PARITY, num_key_value_heads=2, head_dim=32,
                   query_pre_attn_scalar=24, sliding_window=_WINDOW, attn_logit_softcapping=4.0,
                   final_logit_softcapping=6.0, tie_word_embeddings=True, **_NORMS),
    # Gemma 3: q/k norms, local/global layers, local rope base, linear rope on global layers
    "gemma3": dict(arch="gemma3_text", **_PARITY, num_key_value_heads=1, head_dim=32,
                   query_pre_attn_scalar=32, sliding_window=_WINDOW,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}},
                   tie_word_embeddings=False, **_NORMS),
    # Phi-3: fused qkv/gate_up in the checkpoint; partial rotary with LongRoPE (Phi-4-mini), and
    # full rotary with a window (Phi-3-mini-4k)
    "phi3_longrope": dict(arch="phi3", **_PARITY, num_key_value_heads=2, partial_rotary_factor=0.75,
                          original_max_position_embeddings=64, rope_scaling={
                              "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                              "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]},
                          **_SCALED),
    "phi3_window": dict(arch="phi3", **_PARITY, num_key_value_heads=4, sliding_window=_WINDOW,
                        **_SCALED),
    # mixture of experts (every layer routed unless said otherwise): prompts of 200 tokens send
    # rows to every expert; decode steps of a few rows over 16 top-1 experts leave most empty
    "mixtral": dict(arch="mixtral", **_PARITY, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, **_SCALED),
    "mixtral_16x1_window": dict(arch="mixtral", **_PARITY, num_key_value_heads=1, num_local_experts=16,
                                num_experts_per_tok=1, sliding_window=_WINDOW, **_SCALED),
    # Qwen3-MoE: q/k norms, experts of moe_intermediate_size; top-k weights as they come
    # (norm_topk_prob false), and layer 1 a dense MLP (mlp_only_layers)
    "qwen3_moe": dict(arch="qwen3_moe", **_PARITY, num_key_value_heads=2, head_dim=32, num_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=False,
                      mlp_only_layers=[1], **_NORMS),
    # normalised top-k weights; decoder_sparse_step 2 routes only every second layer (layer 1)
    "qwen3_moe_sparse_step": dict(arch="qwen3_moe", **_PARITY, num_key_value_heads=2, num_experts=5,
                                  num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
                                  decoder_sparse_step=2, **_NORMS),
    # Qwen2-MoE: q/k/v bias, a sigmoid-gated shared expert beside 6 routed ones (top 2)
    "qwen2_moe": dict(arch="qwen2_moe", **_PARITY, num_key_value_heads=2, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96, **_SCALED),
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
VARIANTS = {name: SHAPES[name] for name in (
    "llama_mha", "llama3_gqa", "llama_tied", "qwen2_bias", "mistral", "llama_linear_rope", "qwen2_yarn",
    "mistral_window", "qwen2_window", "llama_dynamic_rope", "qwen3", "qwen3_tied_window", "gemma2", "gemma3",
    "phi3_longrope", "phi3_window", "mixtral", "mixtral_16x1_window", "qwen3_moe",
    "qwen3_moe_sparse_step", "qwen2_moe")}
# transformers class names of each family (config class, model class, architecture)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
}


_INIT_KEYS = ("init_std", "bias_std", "norm_std")


def _split(variant: str, over: dict) -> tuple[str, dict, dict]:
    kw = {**SHAPES[variant], **over}
    init = {"init_std": kw.pop("init_std", None), "bias_std": kw.pop("bias_std", 0.0),
            "norm_std": kw.pop("norm_std", 0.0)}
    return kw.pop("arch"), kw, init


def hf_config(variant: str, **over):
    """The transformers config of shape ``variant`` with ``over`` applied."""
    import transformers
    over = {k: v for k, v in over.items() if k not in _INIT_KEYS}
    arch, kw, _ = _split(variant, over)
    cfg = getattr(transformers, FAMILIES[arch][0])(**kw)
    cfg._attn_implementation = "eager"  # the reference math (soft-caps need it)
    return cfg


def make_hf_model(variant: str, seed: int = 0, **over):
    """A random transformers model of shape ``variant`` (eval, fp32). ``over``: config fields, or
    ``init_std``/``bias_std``/``norm_std`` (None/0: transformers' init)."""
    import transformers
    arch, _, init = _split(variant, over)
    cls = getattr(transformers, FAMILIES[arch][1])
    torch.manual_seed(seed)
    model = cls(hf_config(variant, **over)).float().eval()
    if init["init_std"] is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:  # matrices, and the stacked experts [E, out, in]
                    p.normal_(0.0, init["init_std"])
                elif "bias" in name:
                    p.normal_(0.0, init["bias_std"])
                elif name.endswith("norm.weight") and init["norm_std"]:
                    p.add_(torch.randn_like(p) * init["norm_std"])
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
    raw["architectures"] = [FAMILIES[SHAPES[variant]["arch"]][1]]
    return ModelConfig.from_dict(raw)


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]


def hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """HF generate, greedy, one row at a time (no padding effects); returns new tokens.

    LongRoPE models generate without a KV cache: a sequence longer than the pretraining length
    is rotated with the long table at every position, which the uncached forward computes.
    transformers' cached generate means to recompute there (Phi3ForCausalLM drops its cache
    when a sequence crosses that length) but then feeds only the newest token, so from that
    step on it attends to nothing before it (transformers 5.17)."""
    rope = getattr(model.config, "rope_parameters", None) or {}
    cached = rope.get("rope_type") != "longrope"
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=cached)
    return out[0, len(prompt):].tolist()


def greedy_matches_hf(tmp_path, variant: str, device: str) -> None:
    """The engine in fp32 on `device` gives transformers' greedy tokens for six prompts of
    `variant` (1 to 200 tokens, 40 new each)."""
    from batchrun.engine.config import EngineConfig, SamplingParams
    from batchrun.engine.engine import Engine
    from batchrun.engine.request import Request
    hf = save_hf_model(variant, tmp_path / "m")
    prompts = random_prompts(6, [1, 7, 33, 200, 64, 3], hf.config.vocab_size, seed=1)
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device=device,
                                             dtype="float32", max_model_len=512,
                                             max_num_batched_tokens=256))
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    results = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        assert r.finish_reason == "length"
        assert r.output_token_ids == hf_greedy(hf, p, 40), f"prompt len {len(p)}"
