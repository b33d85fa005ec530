"""Loader refuses bad model directories with messages that name the file/tensor and the fix."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchrun.errors import ModelLoadError
from batchrun.engine.models.loader import inspect_model, load_model
from tests.helpers.models import save_hf_model


@pytest.fixture()
def model_dir(tmp_path):
    d = tmp_path / "m"
    save_hf_model("llama_mha", d)
    return d


def _rewrite(d, fn):
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_pickle_checkpoint_refused(tmp_path, model_dir):
    (model_dir / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, model_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"only pickle checkpoints found \(pytorch_model.bin\).*never unpickles"):
        inspect_model(model_dir)


def test_missing_tensor(model_dir):
    _rewrite(model_dir, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\) model.layers.1.mlp.down_proj.weight"):
        inspect_model(model_dir)


def test_wrong_shape(model_dir):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:32].clone()
    _rewrite(model_dir, shrink)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'model.layers.0.self_attn.k_proj.weight' has shape \[32, 64\], config.json implies \[64, 64\]"):
        inspect_model(model_dir)


def test_extra_tensor(model_dir):
    _rewrite(model_dir, lambda t: t.__setitem__("model.layers.0.self_attn.q_norm.weight", torch.ones(16)))
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"):
        inspect_model(model_dir)


def test_unsupported_architecture(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM"):
        inspect_model(model_dir)


def test_remote_code_refused(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_x.X"}
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="never executes"):
        inspect_model(model_dir)


def test_missing_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json: not found"):
        inspect_model(tmp_path / "empty")


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = save_hf_model("qwen2_bias", tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model = load_model(tmp_path / "sharded", torch.device("cpu"), torch.float32, 512)
    q = hf.model.layers[1].self_attn.q_proj
    fused = model.model.layers[1].self_attn.qkv_proj
    assert torch.equal(fused.weight[:q.weight.shape[0]], q.weight)
    assert torch.equal(fused.bias[:q.weight.shape[0]], q.bias)
