"""GPU checks of the mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) on the fused MoE
kernel (kernels/fused_moe.py): fp32 greedy tokens equal transformers', attention and expert LoRA
(the expert deltas inside the fused kernel) mixed with base rows equal peft's, bf16 tracks fp32 as
closely as transformers' bf16 does, graph replay equals eager with adapters mixed in, and a no-LoRA
decode step launches exactly the LoRA-disabled engine's kernels."""
import pytest
import transformers

from tests.engine.test_moe_lora import ADAPTERS, EXPERT_ADAPTERS, run_mixed
from tests.helpers.gpu_checks import (bf16_parity, graph_replay_matches_eager,
                                      no_lora_step_kernels, skinny)  # noqa: F401 (fixture)
from tests.helpers.models import FAMILIES, greedy_matches_hf

pytestmark = pytest.mark.gpu

VARIANTS = ["mixtral", "mixtral_16x1_window", "qwen3_moe", "qwen3_moe_sparse_step", "qwen2_moe"]
ATTENTION = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def _adapters(targets: dict) -> dict:
    return {f"a{i}": dict(r=r, lora_alpha=2 * r, **targets) for i, r in enumerate([8, 4])}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_greedy_matches_hf_on_the_triton_path(tmp_path, variant):
    greedy_matches_hf(tmp_path, variant, "cuda")


@pytest.mark.parametrize("variant", sorted(ADAPTERS))
def test_fp32_attention_lora_matches_peft_on_the_triton_path(tmp_path, variant):
    run_mixed(tmp_path, variant, ADAPTERS[variant], device="cuda")


@pytest.mark.parametrize("variant", sorted(EXPERT_ADAPTERS))
def test_fp32_expert_lora_matches_peft_on_the_triton_path(tmp_path, variant):
    # router and expert deltas (fused_moe_lora) mixed with base rows, eager and graphs
    run_mixed(tmp_path, variant, EXPERT_ADAPTERS[variant], device="cuda")


# Qwen3-30B-A3B's routing (128 experts would be slow to build in HF here: 32 of 1024, top 8)
MID = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=6, num_attention_heads=16,
           num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
           bos_token_id=1, eos_token_id=2)
MID_MOE = {
    "qwen3_moe": dict(MID, intermediate_size=2816, num_experts=32, num_experts_per_tok=8,
                      moe_intermediate_size=512, norm_topk_prob=True),
    "mixtral": dict(MID, intermediate_size=1408, num_local_experts=8, num_experts_per_tok=2),
}


@pytest.mark.parametrize("family", sorted(MID_MOE))
def test_bf16_parity_with_hf(family):
    conf_cls, model_cls = FAMILIES[family]
    bf16_parity(getattr(transformers, conf_cls)(**MID_MOE[family]), model_cls, family,
                prompt_len=96, new_tokens=64, logits=False)


@pytest.mark.parametrize("variant,targets", [
    ("mixtral", ATTENTION), ("qwen3_moe", ATTENTION), ("qwen2_moe", ATTENTION),
    ("mixtral", dict(target_modules="all-linear")), ("qwen3_moe", dict(target_modules="all-linear"))])
def test_graph_replay_matches_eager(tmp_path, variant, targets):
    # peft gives an MoE's stacked gate_up_proj twice the rank (2 x 8)
    graph_replay_matches_eager(tmp_path, variant, adapters=_adapters(targets), max_lora_rank=16)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_no_lora_step_launches_exactly_the_lora_disabled_kernels(tmp_path, variant, skinny):  # noqa: F811
    no_lora_step_kernels(tmp_path, variant, skinny, adapters=_adapters(ATTENTION),
                         max_lora_rank=16)
