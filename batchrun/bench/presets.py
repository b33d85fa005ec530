"""Model shapes for random-weight benchmarks: a preset name stands in for a model directory.

The dicts are Hugging Face config.json contents, parsed by the same ModelConfig.from_dict as a
real checkpoint, so a preset model is built exactly like a loaded one (only the weights differ).
"""
from __future__ import annotations

from batchrun.engine.models import size
from batchrun.engine.models.config import ModelConfig

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
              torch_dtype="bfloat16", tie_word_embeddings=False)
# what Gemma 2 and 3 share: GeGLU, tied embeddings, 16 query / 8 KV heads of 256
_GEMMA = dict(hidden_activation="gelu_pytorch_tanh", torch_dtype="bfloat16", tie_word_embeddings=True,
              num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
              rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1)

PRESETS: dict[str, dict] = {
    "llama-2-7b": dict(_LLAMA, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                       bos_token_id=1, eos_token_id=2),
    "llama-3-8b": dict(_LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                       bos_token_id=128000, eos_token_id=128001),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                     torch_dtype="bfloat16", tie_word_embeddings=False, vocab_size=151936,
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     bos_token_id=151643, eos_token_id=151645),
    "gemma-2-9b": dict(_GEMMA, architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                       vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                       num_hidden_layers=42, sliding_window=4096, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0, max_position_embeddings=8192,
                       rope_theta=10000.0),
    "gemma-3-12b": dict(_GEMMA, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                        vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                        num_hidden_layers=48, sliding_window=1024, sliding_window_pattern=6,
                        max_position_embeddings=131072, rope_theta=1000000.0,
                        rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "phi-4": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_act="silu",
                  torch_dtype="bfloat16", tie_word_embeddings=False, vocab_size=100352,
                  hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384,
                  rms_norm_eps=1e-5, rope_theta=250000.0, sliding_window=None,
                  bos_token_id=100257, eos_token_id=100265),
    # Qwen3-30B-A3B: 128 experts of 768, 8 routed a token (normalised), every layer routed
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          hidden_act="silu", torch_dtype="bfloat16", tie_word_embeddings=False,
                          vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151645),
    # CPU tests: GQA like llama-3, vocab large enough for prompt ids in [100, vocab)
    "tiny": dict(_LLAMA, vocab_size=512, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                 torch_dtype="float32", bos_token_id=1, eos_token_id=2),
}


# `bench throughput --preset`: a short name, or any model preset above
PRESET_MODELS = {"tiny": "tiny", "7b": "llama-2-7b",
                 **{name: name for name in PRESETS if name != "tiny"}}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r} (presets: {', '.join(PRESETS)}); "
                         f"or give a local Hugging Face model directory")
    return ModelConfig.from_dict(dict(PRESETS[name]), where=f"preset {name}")


def num_params(cfg: ModelConfig) -> int:
    """Every parameter of a preset's model (all experts of a mixture-of-experts model)."""
    return size.num_params(cfg)
