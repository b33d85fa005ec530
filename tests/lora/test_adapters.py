"""Adapter loading matches peft's own deltas; every refusal names the adapter, key and fix."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchrun.errors import AdapterError
from batchrun.engine.lora import inspect_adapter, load_adapter
from tests.helpers.adapters import make_adapter, peft_deltas
from tests.helpers.models import model_config

CASES = {
    "list": dict(r=4, lora_alpha=8),
    "rslora_all_linear": dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
    "patterns": dict(r=4, lora_alpha=8, target_modules="all-linear",
                     rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
                     alpha_pattern={"v_proj": 3, "down_proj": 5.5}),
    "patterns_list": dict(r=3, lora_alpha=7, target_modules=["q_proj", "k_proj", "down_proj"],
                          rank_pattern={r"model\.layers\.0\.self_attn\.k_proj": 5},
                          alpha_pattern={"down_proj": 2}),
    "regex": dict(r=4, lora_alpha=4, target_modules=r".*\.(k_proj|up_proj)"),
    "layers_to_transform": dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                layers_to_transform=[1]),
    "layers_pattern": dict(r=2, lora_alpha=8, target_modules=["o_proj", "gate_proj"],
                           layers_to_transform=0, layers_pattern="layers"),
    "some_modules": dict(r=6, lora_alpha=3, target_modules=["o_proj", "gate_proj", "up_proj"]),
    # plain LoRA at inference: their extra tensors (lora_velora_embed, lora_monteclora_sampler.*)
    # only serve training and are skipped
    "velora": dict(r=4, lora_alpha=8, velora_config={"num_groups": 4}),
    "monteclora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], monteclora_config={}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_folded_delta_matches_peft(tmp_path, mcfg, case):
    peft_model = make_adapter(tmp_path, **CASES[case])
    expected = peft_deltas(peft_model)
    loaded = load_adapter("a", tmp_path, mcfg, max_lora_rank=8)
    info = inspect_adapter("a", tmp_path, mcfg, max_lora_rank=8)
    assert info == loaded.info
    got = {(t.layer, t.peft_module): t for t in info.targets}
    assert set(got) == set(expected)  # exactly the modules peft wrapped
    for key, delta in expected.items():
        t = got[key]
        a, b = loaded.weights[(t.layer, t.module, t.slice)]
        assert a.shape[0] == t.rank and b.shape[1] == t.rank
        torch.testing.assert_close(b @ a, delta, rtol=1e-5, atol=1e-6)
    assert info.max_rank == max(t.rank for t in info.targets)


def test_scaling_values(tmp_path, mcfg):
    make_adapter(tmp_path, **CASES["patterns"])
    info = inspect_adapter("a", tmp_path, mcfg, 8)
    by = {(t.layer, t.peft_module): (t.rank, t.scaling) for t in info.targets}
    assert by[(0, "q_proj")] == (2, 8 / 2)
    assert by[(0, "v_proj")] == (4, 3 / 4)
    assert by[(1, "down_proj")] == (6, 5.5 / 6)
    assert by[(0, "down_proj")] == (4, 5.5 / 4)
    make_adapter(tmp_path / "rs", r=4, lora_alpha=8, use_rslora=True)
    assert {t.scaling for t in inspect_adapter("b", tmp_path / "rs", mcfg, 8).targets} == {4.0}


def test_load_dtype(tmp_path, mcfg):
    make_adapter(tmp_path)
    w = load_adapter("a", tmp_path, mcfg, 8, dtype=torch.float16)
    assert all(a.dtype == b.dtype == torch.float16 for a, b in w.weights.values())


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _add_tensor(path, key, shape):
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors[key] = torch.zeros(shape)
    save_file(tensors, str(path / "adapter_model.safetensors"))


REFUSALS = {
    "dora": (dict(use_dora=True), None, ["use_dora=True", "DoRA"]),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), None, ["modules_to_save", "merge"]),
    "embed": (dict(target_modules=["q_proj", "embed_tokens"]), None,
              ["embed_tokens.lora_embedding_A", "embedding or lm_head", "retrain without"]),
    "lm_head": (dict(target_modules=["q_proj", "lm_head"]), None,
                ["lm_head.lora_A.weight", "embedding or lm_head"]),
    "bias": (dict(bias="lora_only"), None, ["bias='lora_only'", "bias='none'"]),
    "pickle": (dict(save_kwargs=dict(safe_serialization=False)), None,
               ["adapter_model.bin is a pickle file", "never loads", "safe_serialization=True"]),
    "hidden_size": (dict(base_over=dict(hidden_size=32, intermediate_size=128)), None,
                    ["shape mismatch for model.layers.0.self_attn.q_proj", "hidden_size=64",
                     "different base model"]),
    "num_layers": (dict(base_over=dict(num_hidden_layers=3)), None,
                   ["is for layer 2", "has 2 layers", "different base model"]),
    "rank": (dict(r=16, lora_alpha=16), None, ["rank 16, above max_lora_rank=8",
                                               "raise engine.max_lora_rank to at least 16"]),
    "unknown_key": (dict(), lambda p: _add_tensor(p, "base_model.model.model.norm.lora_A.weight", [4, 64]),
                    ["'base_model.model.model.norm.lora_A.weight'", "not a LoRA weight"]),
    "arch": (dict(), lambda p: _edit_config(p, auto_mapping={"base_model_class": "Qwen2ForCausalLM"}),
             ["trained on a Qwen2ForCausalLM", "'llama'"]),
    "config_mismatch": (dict(), lambda p: _edit_config(p, target_modules=["q_proj"]),
                        ["v_proj, which adapter_config.json target_modules"]),
    "rank_mismatch": (dict(), lambda p: _edit_config(p, r=2), ["has rank 8 but", "give 2"]),
    "missing_weights": (dict(), lambda p: _edit_config(p, target_modules=["q_proj", "v_proj", "o_proj"]),
                        ["selects model.layers.0.self_attn.o_proj", "no weights"]),
    "peft_type": (dict(), lambda p: _edit_config(p, peft_type="IA3"), ["peft_type='IA3'"]),
    # peft's variants that do not run as plain LoRA on the unmodified base: named, with the fix
    "bdlora": (dict(use_bdlora={"target_modules_bd_a": ["q_proj"], "target_modules_bd_b": ["v_proj"], "nblocks": 2}),
               None, ["use_bdlora=", "BD-LoRA adapters are not supported", "merge_and_unload"]),
    "kasa": (dict(kasa_config={}), None,
             ["kasa_config=", "KaSA adapters are not supported", "lora_diag"]),
    "arrow": (dict(), lambda p: _edit_config(p, arrow_config={"top_k": 2}), ["Arrow adapters"]),
    "pissa": (dict(), lambda p: _edit_config(p, init_lora_weights="pissa_niter_4"),
              ["init_lora_weights='pissa_niter_4'", "PiSSA", "path_initial_model_for_weight_conversion"]),
    "olora": (dict(), lambda p: _edit_config(p, init_lora_weights="olora"), ["OLoRA", "residual base"]),
    "loftq": (dict(), lambda p: _edit_config(p, init_lora_weights="loftq"), ["LoftQ"]),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals(tmp_path, mcfg, case):
    kwargs, edit, needles = REFUSALS[case]
    path = tmp_path / "my-adapter"
    kwargs = {"r": 8, "lora_alpha": 16, **kwargs}
    make_adapter(path, **kwargs)
    if edit:
        edit(path)
    for fn in (inspect_adapter, load_adapter):
        with pytest.raises(AdapterError) as e:
            fn("tone", path, mcfg, 8)
        msg = str(e.value)
        assert msg.startswith(f"LoRA adapter 'tone' ({path}): "), msg
        for needle in needles:
            assert needle in msg, msg


def test_pickle_never_unpickled(tmp_path, mcfg, monkeypatch):
    make_adapter(tmp_path, save_kwargs=dict(safe_serialization=False))
    import pickle
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load called"))
    with pytest.raises(AdapterError, match="pickle"):
        load_adapter("a", tmp_path, mcfg, 8)


def test_missing_dir_and_config(tmp_path, mcfg):
    with pytest.raises(AdapterError, match="not a directory"):
        inspect_adapter("a", tmp_path / "nope", mcfg, 8)
    with pytest.raises(AdapterError, match="adapter_config.json not found"):
        inspect_adapter("a", tmp_path, mcfg, 8)


def test_other_model_types(tmp_path):
    # A qwen2 base: the adapter's class must agree (Llama adapter on Qwen2 base is refused).
    make_adapter(tmp_path)
    qwen = model_config()
    qwen.model_type = "qwen2"
    with pytest.raises(AdapterError, match="trained on a LlamaForCausalLM"):
        inspect_adapter("a", tmp_path, qwen, 8)


@pytest.mark.parametrize("case, part", [("velora", ".lora_velora_embed"), ("monteclora", ".lora_monteclora_sampler.")])
def test_training_only_tensors_are_in_the_file_and_skipped(tmp_path, mcfg, case, part):
    make_adapter(tmp_path, **CASES[case])
    assert any(part in k for k in load_file(str(tmp_path / "adapter_model.safetensors")))
    info = inspect_adapter("a", tmp_path, mcfg, 8)
    assert all(part not in t.key_a and part not in t.key_b for t in info.targets)
