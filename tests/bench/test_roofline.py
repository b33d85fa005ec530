"""bench latency's decode roofline: which HBM peak a device name gets, and the bytes a decode step
must read (every weight but the embedding table, which a tied lm_head streams instead; each row's
K/V), counted against the model's own parameters."""
import pytest

from batchrun.bench.roofline import bf16_peak, decode_bytes_per_step, decode_roofline, hbm_peak
from batchrun.engine.config import EngineConfig
from batchrun.engine.engine import Engine
from tests.helpers.models import save_hf_model


@pytest.mark.parametrize("name,peak", [("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                                       ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA A100-SXM4-80GB", 2.039e12),
                                       ("cpu (x86_64)", None), ("NVIDIA L4", None)])
def test_hbm_peak(name, peak):
    assert hbm_peak(name) == peak


@pytest.mark.parametrize("name,peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                       ("NVIDIA H100 PCIe", 756e12), ("cpu (x86_64)", None)])
def test_bf16_peak(name, peak):
    assert bf16_peak(name) == peak


@pytest.mark.parametrize("variant", ["llama3_gqa", "llama_tied"])
def test_decode_bytes_count_weights_once_and_kv_per_row(tmp_path, variant):
    save_hf_model(variant, tmp_path / "m")
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device="cpu", max_model_len=64))
    named = dict(engine.model.named_parameters(remove_duplicate=False))
    embed = named["model.embed_tokens.weight"]
    expected = sum(p.numel() * 4 for n, p in named.items() if n not in (
        "model.embed_tokens.weight", "lm_head.weight")) + named["lm_head.weight"].numel() * 4
    cfg = engine.model.config
    b = decode_bytes_per_step(engine, batch_size=3, avg_context=10)
    assert b["weights_bytes"] == expected
    assert (named["lm_head.weight"].data_ptr() == embed.data_ptr()) == (variant == "llama_tied")
    assert b["kv_bytes"] == 3 * 10 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    r = decode_roofline(engine, "NVIDIA H200", 3, 4, 12, decode_ms=2.0)
    assert r["kv_bytes"] == 3 * 10 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert r["floor_ms"] == pytest.approx(r["bytes_per_step"] / 4.8e12 * 1e3)
    assert r["fraction_of_peak"] == pytest.approx(r["floor_ms"] / 2.0)
    assert decode_roofline(engine, "NVIDIA H200", 3, 4, 12, decode_ms=None) is None
