"""Memory of mixture-of-experts models: every expert's bytes are counted, in the weight report
and in the check that refuses a model too big for the GPU before its weights load."""
import dataclasses

import pytest
import torch

from batchrun.bench.engine_stats import weight_bytes
from batchrun.bench.presets import preset_config
from batchrun.engine import kv_sizing
from batchrun.engine.config import EngineConfig
from batchrun.engine.models.loader import random_model
from batchrun.engine.models.size import active_params, expert_params, num_params
from batchrun.errors import ConfigError
from tests.helpers.models import model_config

GIB = 1 << 30


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe", "qwen3_moe_sparse_step", "qwen2_moe"])
def test_parameter_count_is_the_models(variant):
    cfg = model_config(variant)
    model = random_model(cfg, torch.device("cpu"), torch.float32, 64)
    assert weight_bytes(model) == 4 * num_params(cfg)  # the report counts every expert
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert experts == expert_params(cfg) > 0
    e = cfg.experts
    per_expert = 3 * cfg.hidden_size * e.intermediate_size
    routed = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert num_params(cfg) - active_params(cfg) == routed * (e.num_experts - e.top_k) * per_expert


def _on_a_gpu_of(total_gib: float, monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(total_gib * GIB),
                                                                         int(total_gib * GIB)))


def test_a_model_too_big_says_by_how_much(monkeypatch):
    cfg = preset_config("qwen3-30b-a3b")
    config = EngineConfig(model="qwen3-30b-a3b", max_model_len=4096, max_num_seqs=64,
                          gpu_memory_utilization=0.9)
    cuda = torch.device("cuda")
    _on_a_gpu_of(80, monkeypatch)  # an H100: 72 GiB for 56.9 GiB of bf16 weights
    kv_sizing.check_weights_fit(cfg, config, cuda, torch.bfloat16)
    _on_a_gpu_of(48, monkeypatch)
    with pytest.raises(ConfigError) as e:
        kv_sizing.check_weights_fit(cfg, config, cuda, torch.bfloat16)
    weights = num_params(cfg) * 2 / GIB
    need = weights + (kv_sizing.activation_reserve(cfg, config, torch.bfloat16)
                      + 257 * kv_sizing.bytes_per_block(cfg, 16, torch.bfloat16)) / GIB
    msg = str(e.value)
    assert f"30.53B parameters take {weights:.1f} GiB in bfloat16 ({expert_params(cfg) * 2 / GIB:.1f} GiB of it experts)" in msg
    assert f"needs {need:.1f} GiB, {need - 48 * 0.9:.1f} GiB more than the 43.2 GiB" in msg
    assert "engine.gpu_memory_utilization=0.9" in msg
    # the CPU engine's weights are not in a device budget
    kv_sizing.check_weights_fit(cfg, config, torch.device("cpu"), torch.bfloat16)


def test_activation_reserve_counts_the_routed_experts():
    # a token of Qwen3-30B-A3B runs 8 experts of 768 (3 x 768 + 2048 each) plus 128 fp32 logits:
    # more than one dense MLP of its intermediate_size (6144, used by no layer)
    cfg = preset_config("qwen3-30b-a3b")
    assert kv_sizing._mlp_activations(cfg) == 8 * (3 * 768 + 2048) + 2 * 128
    dense = dataclasses.replace(cfg, experts=None)
    assert kv_sizing._mlp_activations(dense) == 3 * 6144


def test_decode_roofline_counts_the_experts_a_step_reads(tmp_path):
    # bench latency's bytes per decode step: of a routed layer only the experts its rows reach
    # (expected under uniform routing), the rest of the weights as a dense model's
    from batchrun.bench.roofline import decode_bytes_per_step, experts_read
    from batchrun.engine.engine import Engine
    from tests.helpers.models import save_hf_model
    save_hf_model("qwen3_moe", tmp_path / "m")  # 8 experts, top 3; layer 1 dense
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device="cpu", max_model_len=64))
    cfg = engine.model.config
    named = dict(engine.model.named_parameters())
    per_expert = 3 * 64 * 48 * 4
    everything = sum(p.numel() * 4 for n, p in named.items() if n != "model.embed_tokens.weight")
    assert experts_read(cfg, 1) == pytest.approx(3)
    assert experts_read(cfg, 8) == pytest.approx(8 * (1 - (5 / 8) ** 8))
    for batch in (1, 8):
        b = decode_bytes_per_step(engine, batch_size=batch, avg_context=10)
        read = experts_read(cfg, batch)
        assert b["experts_bytes"] == int(read * per_expert)
        assert b["weights_bytes"] == everything - int((8 - read) * per_expert)


def test_offline_floor_of_an_moe_model():
    # prefill FLOPs of the parameters a token meets (top 8 of 128 experts), not of all 30.5B
    from batchrun.bench.roofline import offline_floor
    cfg = preset_config("qwen3-30b-a3b")
    r = offline_floor(cfg, 1024, 256, 128, 256, "NVIDIA H100 80GB HBM3")
    matmul = active_params(cfg) - cfg.vocab_size * cfg.hidden_size
    attn = 4 * 48 * 32 * 128
    assert r["prefill_s"] == pytest.approx(1024 * (2 * matmul * 256 + attn * 256 * 257 / 2) / 989e12)
    # a decode step of 256 rows reaches nearly every expert: at least all weights' read time
    steps = 4 * 128
    assert r["decode_s"] > steps * 0.99 * (num_params(cfg) - cfg.vocab_size * 2048) * 2 / 3.35e12
