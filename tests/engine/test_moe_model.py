"""Mixture-of-experts models beyond the parity VARIANTS: the stacked-expert checkpoint layout,
which layers route, and that the parity prompts really reach every expert and leave some empty."""
import json

import pytest
import torch
from safetensors.torch import save_file

import batchrun.engine.models.decoder as decoder
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.request import Request
from batchrun.errors import ModelLoadError
from tests.helpers.models import hf_config, hf_greedy, model_config, random_prompts, save_hf_model

NEW = 12


def _engine(path, **kw):
    return Engine.from_config(EngineConfig(model=str(path), device="cpu", max_model_len=512,
                                           max_num_batched_tokens=256, **kw))


def _generate(engine, prompts):
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    return [r.output_token_ids for r in engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])]


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_stacked_expert_checkpoint_matches_hf(tmp_path, variant):
    # transformers 5.17's save_pretrained writes one tensor per expert; a checkpoint holding its
    # in-memory layout (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]) loads too
    hf = save_hf_model(variant, tmp_path / "per_expert")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(stacked / "model.safetensors"))
    (stacked / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    prompts = random_prompts(3, [9, 60, 4], hf.config.vocab_size, seed=2)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    assert _generate(_engine(stacked), prompts) == want


def test_mixtral_checkpoint_uses_published_names(tmp_path):
    # the names the loader maps (w1 gate, w3 up, w2 down): what save_pretrained writes
    from safetensors import safe_open
    save_hf_model("mixtral", tmp_path / "m")
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    assert "model.layers.1.block_sparse_moe.gate.weight" in names


@pytest.mark.parametrize("variant, over", [
    ("qwen3_moe", {}), ("qwen3_moe_sparse_step", {}),
    ("qwen3_moe", dict(num_hidden_layers=6, decoder_sparse_step=3, mlp_only_layers=[5])),
    ("mixtral", {}), ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2))])
def test_routed_layers_match_transformers(variant, over):
    from tests.helpers.models import make_hf_model
    hf = make_hf_model(variant, **over)
    want = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    cfg = model_config(variant, **over)
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == want
    assert any(want)


def test_expert_count_errors_name_the_field():
    raw = hf_config("mixtral").to_dict()
    raw["architectures"] = ["MixtralForCausalLM"]
    raw["num_experts_per_tok"] = 5  # more than the 4 experts
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 5 is more than the 4 experts"):
        ModelConfig.from_dict(raw)
    raw["num_experts_per_tok"], raw["num_local_experts"] = 2, 0
    with pytest.raises(ModelLoadError, match="num_local_experts must be an integer >= 1"):
        ModelConfig.from_dict(raw)


def test_checkpoint_with_other_experts_is_refused(tmp_path):
    save_hf_model("qwen3_moe", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_local_experts"] = 9  # one more expert than the checkpoint holds
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.gate\.weight' has shape "
                                             r"\[8, 64\], config\.json implies \[9, 64\]"):
        _engine(tmp_path / "m")
    cfg["num_local_experts"], cfg["moe_intermediate_size"] = 8, 40
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"mlp\.experts\.\d\.\w+_proj\.weight' has shape"):
        _engine(tmp_path / "m")


def test_parity_prompts_reach_every_expert_and_leave_some_empty(tmp_path, monkeypatch):
    # what test_parity_hf's prompts do to mixtral_16x1_window's router: some step routes rows to
    # all 16 experts, and (decode steps of 6 rows, top-1) some step leaves experts empty
    hf = save_hf_model("mixtral_16x1_window", tmp_path / "m")
    seen = []
    real = decoder.fused_moe

    def spy(x, w1, w2, weights, ids, act):
        seen.append(ids.unique().numel())
        return real(x, w1, w2, weights, ids, act)

    monkeypatch.setattr(decoder, "fused_moe", spy)
    prompts = random_prompts(6, [1, 7, 33, 200, 64, 3], hf.config.vocab_size, seed=1)
    _generate(_engine(tmp_path / "m"), prompts)
    assert max(seen) == 16 and min(seen) < 16


def test_step_plan_shapes_of_moe_models():
    # every layer routed (Mixtral): no dense gate_up/down Linear, so those kinds plan cuBLAS;
    # Qwen3-MoE's dense layer 1 gives them its shapes
    from batchrun.engine.models.loader import random_model
    from batchrun.engine.step_plan import plan_gemms, weight_shapes
    mixtral = random_model(model_config("mixtral"), torch.device("cpu"), torch.float32, 64)
    shapes = weight_shapes(mixtral)
    assert shapes["gate_up_proj"] == shapes["down_proj"] == (0, 0)
    assert shapes["qkv_proj"] == (64 + 2 * 32, 64)
    probe = torch.empty(1, dtype=torch.bfloat16)
    plan = plan_gemms(True, 4, probe, shapes)
    assert plan.gate_up_proj is None and plan.down_proj is None and not plan.gate_up_silu
    qwen = random_model(model_config("qwen3_moe"), torch.device("cpu"), torch.float32, 64)
    assert weight_shapes(qwen)["gate_up_proj"] == (2 * 160, 64)


@pytest.mark.parametrize("variant", ["qwen3_moe", "qwen2_moe"])
def test_qwen_moe_window_only_with_use_sliding_window(variant):
    # transformers drops sliding_window unless use_sliding_window (Qwen3-MoE: None, Qwen2-MoE:
    # 0); a config.json that still carries a window is full attention too
    raw = hf_config(variant).to_dict()
    raw["architectures"] = [{"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[variant]]
    raw.update(use_sliding_window=False, sliding_window=4096)
    raw.pop("layer_types", None)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.sliding_window is None and set(cfg.layer_types) == {"full_attention"}


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_model_from_an_in_memory_hf_model(variant):
    # the GPU parity tests' path: transformers 5's in-memory names (stacked experts) map onto ours
    from batchrun.engine.models.loader import model_from_hf_state
    from tests.helpers.models import make_hf_model
    hf = make_hf_model(variant)
    ours = model_from_hf_state(model_config(variant), hf.state_dict(), torch.device("cpu"), torch.float32, 64)
    params = dict(ours.named_parameters())
    for name, t in hf.state_dict().items():
        if name in params:
            assert torch.equal(params[name], t), name
    assert torch.equal(params["model.layers.0.mlp.experts.gate_up_proj"],
                       hf.model.layers[0].mlp.experts.gate_up_proj)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_moe_on_the_triton_kernels_matches_hf(tmp_path, variant, monkeypatch):
    # the engine's Triton path (kernels/fused_moe.py included) under the interpreter
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    hf = save_hf_model(variant, tmp_path / "m")
    prompts = random_prompts(3, [5, 33, 12], hf.config.vocab_size, seed=1)
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device="cpu",
                                             max_model_len=128, max_num_batched_tokens=64))
    results = engine.generate([Request(i, p, SamplingParams(max_tokens=8, ignore_eos=True))
                               for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        assert r.output_token_ids == hf_greedy(hf, p, 8)
