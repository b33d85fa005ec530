"""LoRA on mixture-of-experts bases, mixed with base rows in one job: greedy tokens equal
transformers + peft's, on the CPU path (shrink + expand in each projection) and on the GPU's
decode plumbing with the torch references (deltas handed to the next op)."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from batchrun.errors import AdapterError
from tests.helpers.adapters import check_mixed_with_peft, parity_adapter
from tests.helpers.models import save_hf_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# per variant: adapter name -> LoraConfig fields
ADAPTERS = {
    "mixtral": {"attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
                "qo": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"])},
    "qwen3_moe": {"attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
                  "vo": dict(r=4, lora_alpha=8, target_modules=["v_proj", "o_proj"])},
    # q/k/v biases stay the base's; LoRA on the shared expert is refused (below)
    "qwen2_moe": {"attn": dict(r=8, lora_alpha=16, target_modules=ATTENTION),
                  "kv": dict(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj"])},
}


def run_mixed(tmp_path, variant: str, adapters: dict, device: str = "cpu"):
    check_mixed_with_peft(tmp_path, variant, adapters, device, seed=300)


@pytest.mark.parametrize("path", ["unfused", "fused_ref"])
@pytest.mark.parametrize("variant", sorted(ADAPTERS))
def test_moe_attention_lora_matches_peft(tmp_path, variant, path, monkeypatch):
    import batchrun.engine.model_runner as model_runner
    if path != "unfused":
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    run_mixed(tmp_path, variant, ADAPTERS[variant])


# LoRA on the expert blocks, as peft 0.21 saves it on transformers 5: "all-linear" becomes the
# attention projections plus target_parameters on the router (gate.weight) and the stacked
# experts (gate_up_proj at twice the rank, down_proj); or the experts alone
EXPERT_ADAPTERS = {
    "mixtral": {"all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
                "down": dict(r=4, lora_alpha=16, target_modules=["q_proj"],
                             target_parameters=["mlp.experts.down_proj"])},
    "qwen3_moe": {"all": dict(r=4, lora_alpha=8, target_modules="all-linear"),
                  "experts": dict(r=2, lora_alpha=8, target_modules=[],
                                  target_parameters=["experts.gate_up_proj", "experts.down_proj"])},
}


@pytest.mark.parametrize("path", ["unfused", "fused_ref", pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("variant", sorted(EXPERT_ADAPTERS))
def test_moe_expert_lora_matches_peft(tmp_path, variant, path, monkeypatch):
    # triton: the GPU's code path under the interpreter, expert deltas inside fused_moe_lora
    import batchrun.engine.model_runner as model_runner
    if path == "fused_ref":
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    calls = []
    if path == "triton":
        import batchrun.kernels.fused_moe as kernel
        monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
        real = kernel.fused_moe_lora
        monkeypatch.setattr(kernel, "fused_moe_lora", lambda *a, **k: calls.append(1) or real(*a, **k))
    run_mixed(tmp_path, variant, EXPERT_ADAPTERS[variant])
    assert bool(calls) == (path == "triton")  # the kernel ran the adapter rows' expert deltas


def test_an_adapter_on_one_expert_tensor_hooks_both_the_other_zero(tmp_path):
    # the fused MoE kernel takes gate_up's and down's slots together
    save_hf_model("qwen3_moe", tmp_path / "base")
    path = _expert_adapter(tmp_path)  # q_proj and the experts' down_proj
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "base"), device="cpu", max_model_len=64,
                                             enable_lora=True, max_loras=1, max_lora_rank=8),
                                adapters={"ad": str(path)})
    engine.generate([Request(0, [5, 6, 7], SamplingParams(max_tokens=2), adapter="ad")])
    hooks = engine.lora.hooks
    assert (0, "router") not in hooks
    assert hooks[(0, "experts_down")].lora_b.abs().sum() > 0
    gate_up = hooks[(0, "experts_gate_up")]
    assert tuple(gate_up.lora_a.shape) == (1, 8, 2, 64) and gate_up.lora_a.abs().sum() == 0


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


def _expert_adapter(tmp_path, variant="qwen3_moe", **kw):
    kw = kw or dict(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=["experts.down_proj"])
    parity_adapter(variant, tmp_path / "ad", 5, kw)
    return tmp_path / "ad"


def _rewrite(path, rename=None, config=None):
    import json
    from safetensors.torch import load_file, save_file
    f = path / "adapter_model.safetensors"
    weights = load_file(str(f))
    if rename is not None:
        weights = {rename(k): v for k, v in weights.items()}
    save_file(weights, str(f))
    if config is not None:
        c = json.loads((path / "adapter_config.json").read_text())
        c.update(config)
        (path / "adapter_config.json").write_text(json.dumps(c))


def _inspect(path, **over):
    from batchrun.engine.lora.adapters import inspect_adapter
    from tests.helpers.models import model_config
    return inspect_adapter("ad", path, model_config("qwen3_moe", **over), max_lora_rank=8)


def test_expert_lora_targets(tmp_path):
    info = _inspect(_expert_adapter(tmp_path))
    assert sorted((t.layer, t.module, t.rank) for t in info.targets) == [
        (0, "experts_down", 2), (0, "qkv_proj", 2), (1, "qkv_proj", 2)]  # layer 1 is dense


def test_transformers_4_per_expert_lora_is_refused(tmp_path):
    path = _expert_adapter(tmp_path)
    # what peft saved on transformers 4's per-expert Linears
    _rewrite(path, rename=lambda k: k.replace("mlp.experts.lora", "mlp.experts.3.down_proj.lora"))
    with pytest.raises(AdapterError, match=r"'base_model\.model\.model\.layers\.0\.mlp\.experts\.3\.down_proj"
                                           r"\.lora_A\.weight' is LoRA on one expert's Linear.*save_pretrained"):
        _inspect(path)


def test_expert_weights_the_config_does_not_select_are_refused(tmp_path):
    path = _expert_adapter(tmp_path)
    _rewrite(path, config={"target_parameters": ["experts.gate_up_proj"]})
    with pytest.raises(AdapterError, match=r"weights for model\.layers\.0\.mlp\.experts\.down_proj, which "
                                           r"adapter_config\.json target_parameters do not select"):
        _inspect(path)


def test_expert_lora_of_another_base_is_refused(tmp_path):
    path = _expert_adapter(tmp_path)
    with pytest.raises(AdapterError, match=r"fit none of layer 0's expert tensors \(router \[E=6, H=64\]"):
        _inspect(path, num_experts=6)  # the base has 6 experts, the adapter's 8
    with pytest.raises(AdapterError, match=r"LoRA on model\.layers\.0\.mlp\.experts, but layer 0 of "
                                           r"the base has no expert block"):
        _inspect(path, mlp_only_layers=[0, 1])


def test_target_parameters_on_a_dense_base_are_refused(tmp_path):
    from batchrun.engine.lora.adapters import inspect_adapter
    from tests.helpers.models import model_config
    parity_adapter("qwen3", tmp_path / "ad", 1, dict(r=2, lora_alpha=4, target_modules=["q_proj"]))
    _rewrite(tmp_path / "ad", config={"target_parameters": ["mlp.down_proj.weight"]})
    with pytest.raises(AdapterError, match=r"target_parameters=\['mlp\.down_proj\.weight'\]: LoRA on raw "
                                           r"parameters is supported on a mixture-of-experts block"):
        inspect_adapter("ad", tmp_path / "ad", model_config("qwen3"), max_lora_rank=8)


def test_shared_expert_lora_is_refused(tmp_path):
    # peft's all-linear on Qwen2-MoE: attention plus the shared expert and its gate
    from batchrun.engine.lora.adapters import inspect_adapter
    from tests.helpers.models import model_config
    parity_adapter("qwen2_moe", tmp_path / "ad", 1, dict(r=2, lora_alpha=4, target_modules="all-linear"))
    with pytest.raises(AdapterError, match=r"is LoRA on model\.layers\.0\.mlp\.shared_expert\.down_proj, "
                                           r"a Qwen2-MoE shared expert, which batchrun does not apply yet"):
        inspect_adapter("ad", tmp_path / "ad", model_config("qwen2_moe"), max_lora_rank=8)


def test_moe_model_and_expert_adapter_validate_without_torch(tmp_path):
    # what `plan` runs: config, checkpoint headers and adapters, torch-free
    import subprocess
    import sys
    from tests.helpers.jobs import REPO
    save_hf_model("mixtral", tmp_path / "base")
    parity_adapter("mixtral", tmp_path / "ad", 1, EXPERT_ADAPTERS["mixtral"]["all"])
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "from batchrun.engine.models.checkpoint import inspect_model\n"
            "from batchrun.engine.lora.adapters import inspect_adapter\n"
            f"cfg = inspect_model({str(tmp_path / 'base')!r})\n"
            f"info = inspect_adapter('ad', {str(tmp_path / 'ad')!r}, cfg, 8)\n"
            "print(sorted({t.module for t in info.targets}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == str(sorted(["experts_down", "experts_gate_up", "o_proj", "qkv_proj", "router"]))


def test_lora_memory_report_counts_expert_slots(tmp_path):
    from batchrun.bench.lora_memory import lora_memory
    save_hf_model("qwen3_moe", tmp_path / "base")
    path = _expert_adapter(tmp_path)  # q_proj and the experts' down_proj, rank 2
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "base"), device="cpu", max_model_len=64,
                                             enable_lora=True, max_loras=1, max_lora_rank=8),
                                adapters={"ad": str(path)})
    hook = engine.lora.hooks[(0, "experts_down")]
    assert tuple(hook.lora_a.shape) == (1, 8, 2, 48) and tuple(hook.lora_b.shape) == (1, 8, 64, 2)
    mem = lora_memory(engine)
    q = engine.lora.hooks[(0, "qkv_proj")]
    gate_up = engine.lora.hooks[(0, "experts_gate_up")]  # hooked with down (kept zero)
    # layer 0's expert tensors, layer 0 and 1's qkv, fp32
    want_a = 4 * (hook.lora_a.numel() + gate_up.lora_a.numel() + 2 * q.lora_a.numel())
    assert mem["slots_a"] == want_a and mem["hooked_linears"] == 4
