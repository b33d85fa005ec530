"""GPU checks per model family (Qwen3, Gemma 2/3, Phi-3, the sliding-window variants): the
Triton path's fp32 greedy tokens equal transformers', bf16 logits and tokens track fp32 as
closely as transformers' bf16 does, graph replay equals eager with adapters mixed in, and a
no-LoRA decode step launches exactly the LoRA-disabled engine's kernels."""
import pytest
import transformers

from tests.helpers.gpu_checks import (bf16_parity, graph_replay_matches_eager,
                                      no_lora_step_kernels, skinny)  # noqa: F401 (fixture)
from tests.helpers.models import FAMILIES, greedy_matches_hf

pytestmark = pytest.mark.gpu

VARIANTS = ["qwen3", "qwen3_tied_window", "gemma2", "gemma3", "phi3_longrope", "phi3_window",
            "mistral_window", "qwen2_window"]
LORA_VARIANTS = ["qwen3", "gemma2", "gemma3", "phi3_longrope"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_greedy_matches_hf_on_the_triton_path(tmp_path, variant):
    greedy_matches_hf(tmp_path, variant, "cuda")


@pytest.mark.parametrize("variant", LORA_VARIANTS)
def test_fp32_lora_matches_peft_on_the_triton_path(tmp_path, variant):
    # fused decode steps: Qwen3's and Gemma 3's qkv delta added before the q/k norms
    # (lora/layer.py add_delta), Gemma's norms and GeGLU taking the deltas
    from tests.engine.test_family_lora import check_family_lora
    check_family_lora(tmp_path, variant, "cuda")


# mid-sized random models of each family: windows shorter than prompt + output
MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
           rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
MID_FAMILIES = {
    "qwen3": dict(MID, head_dim=128),
    "gemma2": dict(MID, head_dim=256, query_pre_attn_scalar=256, sliding_window=64,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(MID, head_dim=256, query_pre_attn_scalar=256, sliding_window=64,
                        sliding_window_pattern=2),
    "phi3": dict(MID, sliding_window=64),
}


@pytest.mark.parametrize("family", sorted(MID_FAMILIES))
def test_bf16_parity_with_hf(family):
    conf_cls, model_cls = FAMILIES[family]
    bf16_parity(getattr(transformers, conf_cls)(**MID_FAMILIES[family]), model_cls, family,
                prompt_len=96, new_tokens=64)


@pytest.mark.parametrize("variant", LORA_VARIANTS)
def test_graph_replay_matches_eager(tmp_path, variant):
    graph_replay_matches_eager(tmp_path, variant)


@pytest.mark.parametrize("variant", LORA_VARIANTS)
def test_no_lora_step_launches_exactly_the_lora_disabled_kernels(tmp_path, variant, skinny):  # noqa: F811
    no_lora_step_kernels(tmp_path, variant, skinny)
