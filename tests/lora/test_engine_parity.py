"""End to end: the engine's greedy tokens with LoRA equal transformers + peft's, in a mixed batch
(base rows and 5 adapters) with fewer GPU slots (2) than adapters and a 1-entry CPU cache."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from batchrun.kernels.lora_meta import LoRADelta
from tests.helpers.adapters import ADAPTERS, assert_results_match_peft, parity_adapter
from tests.helpers.models import random_prompts, save_hf_model

NEW = 8


# How decode steps add LoRA: "unfused" = shrink + expand in each projection (the CPU engine's
# path); "fused_ref" = the GPU decode plumbing (each projection hands its delta to the next op)
# with the torch references; "fused_triton" = that plumbing with every Triton kernel of the GPU
# path running under the interpreter.
@pytest.mark.parametrize("variant,path", [("llama3_gqa", "unfused"), ("qwen2_bias", "unfused"),
                                          ("llama3_gqa", "fused_ref"), ("qwen2_bias", "fused_ref"),
                                          pytest.param("llama3_gqa", "fused_triton", marks=pytest.mark.slow)])
def test_engine_matches_peft(tmp_path, variant, path, monkeypatch):
    import batchrun.engine.model_runner as model_runner
    if path != "unfused":
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    if path == "fused_triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    # count deltas that reached a consumer: the reference applies them, the kernels validate
    fused = []
    for name in ("apply_reference", "validate"):
        orig = getattr(LoRADelta, name)
        monkeypatch.setattr(LoRADelta, name,
                            lambda self, *a, _orig=orig, **k: (fused.append(1), _orig(self, *a, **k))[1])
    base = save_hf_model(variant, tmp_path / "base")
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        paths[name] = tmp_path / name
        parity_adapter(variant, paths[name], 100 + i, kw)

    # 5 adapters through 2 GPU slots and a 1-entry CPU cache: slots are evicted and reloaded
    names = [None, "qv", "all", "mlp1", None, "o", "all", "qkv", "qv", "mlp1", "o", "all", "qkv"]
    prompts = random_prompts(len(names), [5, 17, 40, 3, 29], base.config.vocab_size, seed=3)
    engine = Engine.from_config(
        EngineConfig(model=str(tmp_path / "base"), device="cpu", max_model_len=128,
                     max_num_batched_tokens=32, enable_lora=True, max_loras=2, max_lora_rank=8,
                     max_cpu_loras=1), adapters={n: str(p) for n, p in paths.items()})
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    decode_slots = []  # the engine hands LoRA decode steps their rows in slot order
    orig_decode = engine.runner.decode
    monkeypatch.setattr(engine.runner, "decode", lambda batch, prev=None: (
        decode_slots.append([s.lora_slot for s in batch.seqs]), orig_decode(batch, prev))[1])
    results = engine.generate([Request(i, p, sp, adapter=n)
                               for i, (p, n) in enumerate(zip(prompts, names))])
    assert any(len(set(d)) > 1 for d in decode_slots)
    assert all(d == sorted(d) for d in decode_slots if max(d) >= 0)

    assert set(paths) == set(ADAPTERS)
    assert_results_match_peft(variant, base, paths, prompts, names, results, NEW)
    assert engine.lora.num_loads >= 5
    assert (len(fused) > 0) == (path != "unfused")
