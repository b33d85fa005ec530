"""LoRA on mixture-of-experts bases, mixed with base rows in one job: greedy tokens equal
transformers + peft's, on the CPU path (shrink + expand in each projection) and on the GPU's
decode plumbing with the torch references (deltas handed to the next op)."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from batchrun.errors import AdapterError
from tests.helpers.adapters import assert_results_match_peft, parity_adapter
from tests.helpers.models import random_prompts, save_hf_model

NEW = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# per variant: adapter name -> LoraConfig fields
ADAPTERS = {
    "mixtral": {"attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
                "qo": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])},
    "qwen3_moe": {"attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
                  "vo": dict(r=4, lora_alpha=8, target_modules=["v_proj", "o_proj"])},
}


def run_mixed(tmp_path, variant: str, adapters: dict, device: str = "cpu"):
    base = save_hf_model(variant, tmp_path / "base")
    paths = {}
    for i, (name, kw) in enumerate(adapters.items()):
        paths[name] = tmp_path / name
        parity_adapter(variant, paths[name], 300 + i, kw)
    first, second = list(adapters)
    names = [None, first, second, None, first, second, first]
    prompts = random_prompts(len(names), [5, 70, 17, 90, 3], base.config.vocab_size, seed=4)
    engine = Engine.from_config(
        EngineConfig(model=str(tmp_path / "base"), device=device, dtype="float32", max_model_len=256,
                     max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8),
        adapters={n: str(p) for n, p in paths.items()})
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    results = engine.generate([Request(i, p, sp, adapter=n)
                               for i, (p, n) in enumerate(zip(prompts, names))])
    assert_results_match_peft(variant, base, paths, prompts, names, results, NEW)


@pytest.mark.parametrize("path", ["unfused", "fused_ref"])
@pytest.mark.parametrize("variant", sorted(ADAPTERS))
def test_moe_attention_lora_matches_peft(tmp_path, variant, path, monkeypatch):
    import batchrun.engine.model_runner as model_runner
    if path != "unfused":
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    run_mixed(tmp_path, variant, ADAPTERS[variant])


def test_dense_mlp_lora_on_a_routed_layer_is_refused(tmp_path):
    # an adapter of a dense Qwen3 (same attention shapes) whose layer 0 MLP the MoE base
    # replaces with experts
    save_hf_model("qwen3_moe", tmp_path / "base")
    parity_adapter("qwen3", tmp_path / "dense", 1, dict(r=4, lora_alpha=8, target_modules=["up_proj"]))
    cfg = tmp_path / "dense" / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"Qwen3ForCausalLM"', '"Qwen3MoeForCausalLM"'))
    with pytest.raises(AdapterError, match=r"LoRA on model\.layers\.0\.mlp\.up_proj, but layer 0 of this "
                                           r"qwen3_moe base routes through experts"):
        Engine.from_config(EngineConfig(model=str(tmp_path / "base"), device="cpu", max_model_len=64,
                                        enable_lora=True, max_loras=1, max_lora_rank=8),
                           adapters={"dense": str(tmp_path / "dense")})
