"""FP8 checkpoints and on-the-fly FP8 on the CPU: greedy rows equal transformers running the
declared quantized math in fp32 (tests/helpers/fp8.py), for every checkpoint format batchrun
reads; bad checkpoints fail naming the tensor or field."""
import json

import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from batchrun.errors import ModelLoadError
from tests.helpers.adapters import parity_adapter
from tests.helpers.fp8 import SCHEMES, fp8_reference, quantize_weight, save_fp8_checkpoint
from tests.helpers.models import hf_greedy, make_hf_model, random_prompts, save_hf_model

NEW = 16
LENGTHS = [5, 40, 70]


def _engine(path, **kw):
    # one row at a time: dynamic per-tensor activation scales depend on every row of a step,
    # and the reference runs each prompt alone
    kw = {"max_num_seqs": 1, **kw}
    return Engine.from_config(EngineConfig(model=str(path), device="cpu", max_model_len=256,
                                           max_num_batched_tokens=256, **kw))


def _check(engine, ref, plain, vocab, adapters=None):
    prompts = random_prompts(len(LENGTHS), LENGTHS, vocab, seed=3)
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    results = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    differs = False
    for p, r in zip(prompts, results):
        assert r.output_token_ids == hf_greedy(ref, p, NEW), f"prompt len {len(p)}"
        differs |= r.output_token_ids != hf_greedy(plain, p, NEW)
    assert differs  # the FP8 math changes some row, so the comparison could fail


@pytest.mark.slow
@pytest.mark.parametrize("variant,scheme", [("llama3_gqa", s) for s in sorted(SCHEMES)]
                         + [("qwen2_bias", "ct_channel_token"), ("qwen3", "hf_block")])
def test_fp8_checkpoint_matches_the_declared_math(tmp_path, variant, scheme):
    hf = make_hf_model(variant)
    quantized = save_fp8_checkpoint(hf, tmp_path / "m", scheme)
    _check(_engine(tmp_path / "m"), fp8_reference(hf, quantized, scheme), hf, hf.config.vocab_size)


@pytest.mark.slow
def test_ignored_modules_stay_unquantized(tmp_path):
    hf = make_hf_model("llama3_gqa")
    ignore = ["model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"]
    quantized = save_fp8_checkpoint(hf, tmp_path / "m", "ct_channel_token", ignore=ignore)
    engine = _engine(tmp_path / "m")
    layers = engine.model.model.layers
    assert layers[1].mlp.down_proj.quant is None and layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    _check(engine, fp8_reference(hf, quantized, "ct_channel_token"), hf, hf.config.vocab_size)


@pytest.mark.slow
def test_on_the_fly_fp8_is_per_channel_weights_per_token_activations(tmp_path):
    hf = save_hf_model("llama3_gqa", tmp_path / "m")
    quantized = {}
    for name, module in hf.named_modules():
        if name.endswith(("_proj",)) and ".layers." in name:
            q, s = quantize_weight(module.weight.detach(), "channel", None)
            quantized[name] = (q, s, None)
    engine = _engine(tmp_path / "m", quantization="fp8")
    w = engine.model.model.layers[0].self_attn.qkv_proj
    assert w.weight.dtype == torch.float8_e4m3fn and w.weight_scale.shape == (w.out_features,)
    assert engine.model.lm_head.weight.dtype == torch.float32  # lm_head stays in the model dtype
    _check(engine, fp8_reference(hf, quantized, "ct_channel_token"), hf, hf.config.vocab_size)


@pytest.mark.slow
def test_lora_on_an_fp8_base_matches_peft_over_the_fp8_reference(tmp_path):
    from peft import PeftModel
    hf = make_hf_model("llama3_gqa")
    quantized = save_fp8_checkpoint(hf, tmp_path / "m", "ct_channel_token")
    paths = {"all": tmp_path / "all"}
    parity_adapter("llama3_gqa", paths["all"], 200, dict(r=8, lora_alpha=16,
                                                         target_modules="all-linear"))
    engine = Engine.from_config(EngineConfig(
        model=str(tmp_path / "m"), device="cpu", max_model_len=256, max_num_batched_tokens=64,
        enable_lora=True, max_loras=2, max_lora_rank=8), adapters={"all": str(paths["all"])})
    names = [None, "all", None, "all"]
    prompts = random_prompts(len(names), [5, 70, 17, 40], hf.config.vocab_size, seed=4)
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    results = engine.generate([Request(i, p, sp, adapter=n)
                               for i, (p, n) in enumerate(zip(prompts, names))])
    base = fp8_reference(hf, quantized, "ct_channel_token")
    refs = {None: base, "all": PeftModel.from_pretrained(
        fp8_reference(hf, quantized, "ct_channel_token"), str(paths["all"])).eval()}
    for p, n, r in zip(prompts, names, results):
        assert r.output_token_ids == hf_greedy(refs[n], p, NEW), f"adapter {n}, len {len(p)}"
    assert any(r.output_token_ids != hf_greedy(base, p, NEW)
               for p, n, r in zip(prompts, names, results) if n)


# ---- refusals --------------------------------------------------------------------------------

def _fp8_dir(tmp_path, scheme="ct_channel_token", **kw):
    hf = make_hf_model("llama_mha")
    save_fp8_checkpoint(hf, tmp_path / "m", scheme, **kw)
    return tmp_path / "m"


def _edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg["quantization_config"]) if "quantization_config" in cfg else None
    edit_top = getattr(edit, "top", None)
    if edit_top:
        edit_top(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, edit):
    from safetensors.torch import load_file, save_file
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"))


def _inspect(path):
    from batchrun.engine.models.checkpoint import inspect_model
    return inspect_model(path)


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported.*FP8 checkpoints"),
    ({"quant_method": "gptq"}, r"quant_method 'gptq' is not supported"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"},
     r"quantization_config.weight_block_size is None.*block-scaled"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     r"quantization_config.activation_scheme is 'static'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
     r"quantization_config.format is 'pack-quantized'"),
])
def test_unsupported_quantization_configs_are_refused_naming_the_field(tmp_path, quant, match):
    save_hf_model("llama_mha", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = quant
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=match):
        _inspect(tmp_path / "m")


def test_weight_only_and_int8_compressed_tensors_are_refused(tmp_path):
    path = _fp8_dir(tmp_path)
    _edit_config(path, lambda q: q["config_groups"]["group_0"].pop("input_activations"))
    with pytest.raises(ModelLoadError, match=r"input_activations is None.*W8A8"):
        _inspect(path)
    _edit_config(path, lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
        weights={"num_bits": 8, "type": "int", "strategy": "channel"}))
    with pytest.raises(ModelLoadError, match=r"weights is \{'type': 'int', 'num_bits': 8\}"):
        _inspect(path)


def test_a_missing_scale_is_named(tmp_path):
    path = _fp8_dir(tmp_path)
    _edit_tensors(path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight_scale"))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) model.layers.1.mlp.up_proj.weight_scale"):
        _inspect(path)


def test_a_missing_input_scale_of_a_static_scheme_is_named(tmp_path):
    path = _fp8_dir(tmp_path, "ct_tensor_static")
    _edit_tensors(path, lambda s: s.pop("model.layers.0.self_attn.k_proj.input_scale"))
    with pytest.raises(ModelLoadError, match=r"model.layers.0.self_attn.k_proj.input_scale"):
        _inspect(path)


def test_a_wrong_scale_layout_is_named(tmp_path):
    path = _fp8_dir(tmp_path, "hf_block")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    _edit_tensors(path, lambda s: s.update({name: s[name].t().contiguous().repeat(1, 3)}))
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}' has shape .* implies \[2, 5\]"):
        _inspect(path)


def test_a_bf16_weight_where_the_scheme_says_fp8_is_named(tmp_path):
    path = _fp8_dir(tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    _edit_tensors(path, lambda s: s.update({name: s[name].float()}))
    with pytest.raises(ModelLoadError, match=rf"'{name}' is F32, but quantization_config quantizes"):
        _inspect(path)


def test_an_fp8_tensor_without_a_quantization_config_is_named(tmp_path):
    path = _fp8_dir(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"is FP8 \(F8_E4M3\) but config.json has no FP8 "
                                             r"quantization_config"):
        _inspect(path)


def test_a_fused_projection_half_ignored_is_refused(tmp_path):
    path = _fp8_dir(tmp_path, ignore=["model.layers.0.self_attn.q_proj"])
    _inspect(path)  # the checkpoint itself is consistent
    with pytest.raises(ModelLoadError, match=r"quantizes .*k_proj.* but not "
                                             r"\['model.layers.0.self_attn.q_proj'\].*one fused"):
        _engine(path)


# ---- FP8 KV cache ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("with_scales", [False, True])
def test_fp8_kv_cache_matches_attention_over_e4m3_k_and_v(tmp_path, with_scales):
    from safetensors.torch import load_file, save_file
    from tests.helpers.fp8 import fp8_kv_attention
    hf = save_hf_model("llama3_gqa", tmp_path / "m")
    scales = None
    if with_scales:  # a kv_cache_scheme checkpoint's per-layer scales
        scales = {i: (0.004 + 0.001 * i, 0.003 + 0.002 * i) for i in range(hf.config.num_hidden_layers)}
        state = load_file(str(tmp_path / "m" / "model.safetensors"))
        for i, (k, v) in scales.items():
            state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
            state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])
        save_file(state, str(tmp_path / "m" / "model.safetensors"))
    engine = _engine(tmp_path / "m", kv_cache_dtype="fp8", max_num_seqs=4)
    assert engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    ref = fp8_kv_attention(make_hf_model("llama3_gqa"), scales)
    _check(engine, ref, hf, hf.config.vocab_size)


@pytest.mark.slow
def test_fp8_weights_and_fp8_kv_cache_together(tmp_path):
    from tests.helpers.fp8 import fp8_kv_attention
    hf = make_hf_model("qwen2_bias")
    quantized = save_fp8_checkpoint(hf, tmp_path / "m", "ct_channel_token")
    engine = _engine(tmp_path / "m", kv_cache_dtype="fp8", max_num_seqs=4)
    ref = fp8_kv_attention(fp8_reference(hf, quantized, "ct_channel_token"))
    _check(engine, ref, hf, hf.config.vocab_size)


def test_kv_cache_scales_without_fp8_kv_are_not_applied(tmp_path):
    # a checkpoint's k/v scales only mean something for an e4m3 cache
    from safetensors.torch import load_file, save_file
    save_hf_model("llama_mha", tmp_path / "m")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    engine = _engine(tmp_path / "m")
    attn = engine.model.model.layers[0].self_attn.attn
    assert attn.checkpoint_kv_scales == (0.5, 1.0) and attn.k_scale == 1.0
