"""models/loader.py loads each checkpoint tensor once into a model materialised in the target
dtype; the staged (pinned, double-buffered) path the GPU uses gives the same bytes as the direct
path. The staged path runs here on CPU with tiny buffers, so chunking and buffer reuse are
exercised (on CPU its buffers are not pinned and its copies are synchronous)."""
import pytest
import torch
from safetensors.torch import load_file

from batchrun.engine.models import loader
from batchrun.engine.models.stage import StagedCopier
from tests.helpers.models import save_hf_model


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("buffer_bytes", [96, 4096])  # 96: most tensors in several chunks
def test_staged_copies_equal_direct_copies(tmp_path, monkeypatch, dtype, buffer_bytes):
    save_hf_model("qwen2_bias", tmp_path / "m", max_shard_size="20KB")
    direct = _params(loader.load_model(tmp_path / "m", torch.device("cpu"), dtype, 512))
    real = StagedCopier
    monkeypatch.setattr(loader, "StagedCopier",
                        lambda device, dt: real(device, dt, staged=True, buffer_bytes=buffer_bytes))
    staged = _params(loader.load_model(tmp_path / "m", torch.device("cpu"), dtype, 512))
    assert direct.keys() == staged.keys()
    for k in direct:
        assert direct[k].dtype == staged[k].dtype and torch.equal(direct[k], staged[k]), k


def test_weights_are_the_checkpoints_converted_once(tmp_path):
    hf = save_hf_model("llama_mha", tmp_path / "m")
    model = loader.load_model(tmp_path / "m", torch.device("cpu"), torch.bfloat16, 512)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.cos_sin.dtype == torch.float32  # the rotary table stays fp32
    ckpt = load_file(str(tmp_path / "m" / "model.safetensors"))
    k = ckpt["model.layers.0.self_attn.k_proj.weight"]
    fused = model.model.layers[0].self_attn.qkv_proj.weight
    q_rows = hf.model.layers[0].self_attn.q_proj.weight.shape[0]
    assert torch.equal(fused[q_rows:q_rows + k.shape[0]], k.to(torch.bfloat16))


def test_staged_reader_errors_reach_the_caller():
    dst = torch.empty(4, 4)
    with pytest.raises(ValueError, match=r"shape \[2, 4\] for a parameter of shape \[4, 4\]"):
        with StagedCopier(torch.device("cpu"), torch.float32, staged=True, buffer_bytes=16) as c:
            c.copy(dst, lambda: torch.zeros(2, 4))
    with pytest.raises(RuntimeError, match="boom"):
        with StagedCopier(torch.device("cpu"), torch.float32, staged=True, buffer_bytes=16) as c:
            c.copy(torch.empty(8), lambda: torch.ones(8))
            c.copy(dst, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
