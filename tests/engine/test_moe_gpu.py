"""GPU checks of the mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) on the fused MoE
kernel (kernels/fused_moe.py): fp32 greedy tokens equal transformers', attention and expert LoRA
(the expert deltas inside the fused kernel) mixed with base rows equal peft's, bf16 tracks fp32 as
closely as transformers' bf16 does, graph replay equals eager with adapters mixed in, and a no-LoRA
decode step launches exactly the LoRA-disabled engine's kernels."""
import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.models.loader import model_from_hf_state
from batchrun.engine.request import Request
from tests.engine.test_moe_lora import ADAPTERS, EXPERT_ADAPTERS, run_mixed
from tests.gpu.test_engine_gpu import _kernels_of_one_decode_step, skinny  # noqa: F401 (fixture)
from tests.helpers.adapters import parity_adapter
from tests.helpers.models import FAMILIES, hf_greedy, random_prompts, save_hf_model

pytestmark = pytest.mark.gpu

VARIANTS = ["mixtral", "mixtral_16x1_window", "qwen3_moe", "qwen3_moe_sparse_step", "qwen2_moe"]
ATTENTION = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_greedy_matches_hf_on_the_triton_path(tmp_path, variant):
    hf = save_hf_model(variant, tmp_path / "m")
    prompts = random_prompts(6, [1, 7, 33, 200, 64, 3], hf.config.vocab_size, seed=1)
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device="cuda",
                                             dtype="float32", max_model_len=512,
                                             max_num_batched_tokens=256))
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    results = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        assert r.output_token_ids == hf_greedy(hf, p, 40), f"prompt len {len(p)}"


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
    """bf16 error against an fp32 reference no worse than HF's own bf16 (as the dense families')."""
    import transformers
    conf_cls, model_cls = FAMILIES[family]
    raw = MID_MOE[family]
    torch.manual_seed(0)
    conf = getattr(transformers, conf_cls)(**raw)
    conf._attn_implementation = "eager"
    with torch.device("cuda"):
        hf = getattr(transformers, model_cls)(conf).to(torch.bfloat16).eval()
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.data.add_(torch.randn_like(p) * 0.1)
    cfg = ModelConfig.from_dict(dict(hf.config.to_dict(), architectures=[model_cls], torch_dtype="bfloat16"))
    ours = model_from_hf_state(cfg, hf.state_dict(), torch.device("cuda"), torch.bfloat16, 4096)
    engine = Engine.from_model(EngineConfig(model=family, max_model_len=512, max_num_seqs=8), ours)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 32000, (96,), generator=g).tolist() for _ in range(8)]
    ids = torch.tensor(prompts, device="cuda")
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
               do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf_tokens = hf.generate(ids, **gen)[:, 96:].tolist()
        hf.float()
        fp32_tokens = hf.generate(ids, **gen)[:, 96:].tolist()
    del hf
    torch.cuda.empty_cache()
    res = engine.generate([Request(i, p, SamplingParams(max_tokens=64, ignore_eos=True))
                           for i, p in enumerate(prompts)])
    ours_tokens = [r.output_token_ids for r in res]
    rate = lambda a, b: sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / (8 * 64)  # noqa: E731
    print(f"{family}: greedy match ours/fp32 {rate(ours_tokens, fp32_tokens):.3f}, "
          f"HF bf16/fp32 {rate(hf_tokens, fp32_tokens):.3f}")
    assert rate(ours_tokens, fp32_tokens) >= 0.8 * rate(hf_tokens, fp32_tokens) - 0.05


def _engine(tmp_path, variant, enforce_eager, enable_lora=True, dtype="float32", targets=ATTENTION):
    save_hf_model(variant, tmp_path / "base")
    adapters = {}
    for i, r in enumerate([8, 4]):
        parity_adapter(variant, tmp_path / f"a{i}", 300 + i, dict(r=r, lora_alpha=2 * r, **targets))
        adapters[f"a{i}"] = str(tmp_path / f"a{i}")
    cfg = EngineConfig(model=str(tmp_path / "base"), device="cuda", dtype=dtype, max_model_len=256,
                       max_num_seqs=16, enable_lora=enable_lora, max_loras=2,
                       # peft gives an MoE's stacked gate_up_proj twice the rank (2 x 8)
                       max_lora_rank=16, enforce_eager=enforce_eager)
    return Engine.from_config(cfg, adapters if enable_lora else None), adapters


def _requests(adapters, vocab):
    names = [None] + sorted(adapters)
    prompts = random_prompts(11, [5, 70, 17, 90, 3], vocab, seed=2)
    return [Request(i, p, SamplingParams(max_tokens=24, ignore_eos=True), names[i % len(names)])
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("variant,targets", [
    ("mixtral", ATTENTION), ("qwen3_moe", ATTENTION), ("qwen2_moe", ATTENTION),
    ("mixtral", dict(target_modules="all-linear")), ("qwen3_moe", dict(target_modules="all-linear"))])
def test_graph_replay_matches_eager(tmp_path, variant, targets):
    eager, adapters = _engine(tmp_path / "e", variant, True, targets=targets)
    graphs, _ = _engine(tmp_path / "g", variant, False, targets=targets)
    assert graphs.runner.graphs is not None
    reqs = _requests(adapters, 211)
    assert ([r.output_token_ids for r in eager.generate(reqs)]
            == [r.output_token_ids for r in graphs.generate(reqs)])


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_no_lora_step_launches_exactly_the_lora_disabled_kernels(tmp_path, variant, skinny):  # noqa: F811
    dtype = "bfloat16" if skinny else "float32"
    base, adapters = _engine(tmp_path / "a", variant, True, enable_lora=False, dtype=dtype)
    lora, _ = _engine(tmp_path / "b", variant, True, enable_lora=True, dtype=dtype)
    prompts = [r.prompt_token_ids for r in _requests(adapters, 211)[:8]]
    k_base = _kernels_of_one_decode_step(base, prompts)
    k_lora = _kernels_of_one_decode_step(lora, prompts)
    assert sum(k_base.values()) > 0
    assert k_lora == k_base, f"extra: {k_lora - k_base}, missing: {k_base - k_lora}"
