"""Random PEFT adapters: peft's file format, accepted by the adapter loader, and they change
the engine's outputs for the rows that use them (B is random, not zero)."""
import json

import torch
from safetensors import safe_open

from batchrun.bench.adapters import write_random_adapters
from batchrun.engine.lora.peft_config import PEFT_MODULES
from batchrun.bench.build import build_engine, make_requests, random_prompts
from batchrun.engine.config import EngineConfig
from batchrun.bench.presets import PRESETS, num_params, preset_config
from batchrun.engine.lora.adapters import inspect_adapter
from batchrun.engine.models.size import active_params


def test_presets_have_the_real_shapes():
    assert round(num_params(preset_config("llama-2-7b")) / 1e9, 2) == 6.74
    l3 = preset_config("llama-3-8b")
    assert round(num_params(l3) / 1e9, 2) == 8.03
    assert (l3.num_key_value_heads, l3.vocab_size, l3.rope_scaling["rope_type"]) == (8, 128256, "llama3")
    assert preset_config("llama-2-7b").torch_dtype == "bfloat16"
    assert set(PRESETS) >= {"llama-2-7b", "llama-3-8b", "tiny"}
    # the families' benchmark shapes (parameter counts of the published checkpoints' text models)
    sizes = {n: round(num_params(preset_config(n)) / 1e9, 2)
             for n in ("qwen3-8b", "gemma-2-9b", "gemma-3-12b", "phi-4")}
    assert sizes == {"qwen3-8b": 8.19, "gemma-2-9b": 9.24, "gemma-3-12b": 11.77, "phi-4": 14.66}
    # Qwen3-30B-A3B: 30.5B parameters (its model card's figure); a token reads 8 of 128 experts
    # a layer, 3.35B with the embedding and lm_head (the card's "3.3B activated")
    moe = preset_config("qwen3-30b-a3b")
    assert round(num_params(moe) / 1e9, 2) == 30.53
    assert round(active_params(moe) / 1e9, 2) == 3.35
    assert (moe.experts.num_experts, moe.experts.top_k, moe.experts.intermediate_size) == (128, 8, 768)
    assert moe.experts.norm_topk_prob and all(moe.is_moe_layer(i) for i in range(48))


def test_random_adapters_name_the_family_modules(tmp_path):
    # Phi-3's Linears are fused in transformers too: its adapters target qkv_proj/gate_up_proj
    cfg = preset_config("phi-4")
    d = write_random_adapters(tmp_path, cfg, 1, rank=1)["lora0"]
    conf = json.loads((tmp_path / "lora0" / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    info = inspect_adapter("lora0", d, cfg, max_lora_rank=16)
    assert len(info.targets) == cfg.num_hidden_layers * 7  # q, k, v, o, gate, up, down slices


def test_random_adapter_files(tmp_path):
    cfg = preset_config("tiny")
    dirs = write_random_adapters(tmp_path, cfg, 2, rank=8, base_model="tiny")
    assert sorted(dirs) == ["lora0", "lora1"]
    conf = json.loads((tmp_path / "lora0" / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 8 and conf["lora_alpha"] == 16
    assert conf["target_modules"] == list(PEFT_MODULES) and len(PEFT_MODULES) == 7
    assert conf["bias"] == "none" and conf["task_type"] == "CAUSAL_LM"
    assert conf["base_model_name_or_path"] == "tiny"
    with safe_open(str(tmp_path / "lora0" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        a = f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight")
        b = f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
    assert len(keys) == cfg.num_hidden_layers * 7 * 2
    assert a.shape == (8, cfg.intermediate_size) and b.shape == (cfg.hidden_size, 8)
    assert a.dtype == b.dtype == torch.bfloat16 and b.abs().sum() > 0
    info = inspect_adapter("lora0", dirs["lora0"], cfg, max_lora_rank=16)
    assert info.max_rank == 8 and len(info.targets) == cfg.num_hidden_layers * 7


def test_random_adapters_change_outputs_through_the_engine(tmp_path):
    base = build_engine(EngineConfig(model="tiny", device="cpu", max_model_len=32, max_num_seqs=8))
    lora = build_engine(EngineConfig(model="tiny", device="cpu", max_model_len=32, max_num_seqs=8,
                                     enable_lora=True, max_loras=2),
                        num_adapters=2, lora_rank=8, adapter_root=tmp_path)
    assert lora.weights == "random" and sorted(lora.adapters) == ["lora0", "lora1"]
    prompts = random_prompts(4, 8, 512, seed=3)
    rows = ["lora0", "lora1", None, None]
    out_base = [r.output_token_ids for r in base.engine.generate(make_requests(prompts, 12))]
    out_lora = [r.output_token_ids for r in lora.engine.generate(make_requests(prompts, 12, rows))]
    # same seed -> same random base weights: base rows agree, adapter rows differ
    assert out_lora[2:] == out_base[2:]
    assert out_lora[0] != out_base[0] and out_lora[1] != out_base[1]
    assert out_lora[0] != out_lora[1]
