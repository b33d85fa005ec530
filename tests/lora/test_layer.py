"""The Linear hook: mixed LoRA / no-LoRA batches equal a dense per-row computation using peft's
own deltas; a no-LoRA step is exactly the base output and launches no LoRA op."""
import pytest
import torch

from batchrun.lora import punica
from batchrun.lora.manager import LoRAManager
from batchrun.lora.peft_config import PEFT_MODULES
from tests.lora.conftest import FakeLlama, make_adapter, peft_deltas

ADAPTERS = {  # name -> LoraConfig kwargs (different targets and ranks)
    "x": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "y": dict(r=8, lora_alpha=4, use_rslora=True, target_modules="all-linear"),
    "z": dict(r=2, lora_alpha=2, target_modules=["k_proj", "up_proj"], layers_to_transform=[1]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hook")
    deltas = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        deltas[name] = peft_deltas(make_adapter(root / name, seed=10 + i, **kw))
    return {n: root / n for n in ADAPTERS}, deltas


def _dense_delta(deltas, layer, module, lin):
    """Fused [out, in] delta of one adapter for one of our Linears (zeros where untargeted)."""
    parts = []
    slices = {sl: p for p, (_, mod, sl) in PEFT_MODULES.items() if mod == module}
    for s, n in enumerate(lin.output_sizes):
        d = deltas.get((layer, slices[s]))
        parts.append(d if d is not None else torch.zeros(n, lin.in_features))
    return torch.cat(parts)


def _run(mcfg, setup, monkeypatch, force_triton):
    if force_triton:
        monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    paths, deltas = setup
    model = FakeLlama(mcfg)
    m = LoRAManager(model, paths, max_loras=4, max_lora_rank=8, max_num_tokens=32,
                    device="cpu", dtype=torch.float32)
    slots = {n: m.acquire(n) for n in ("z", "x", "y")}
    names = [None, "x", "y", None, "z", "x", "y", "y", None, "z", "x"]
    token_slots = [-1 if n is None else slots[n] for n in names]
    g = torch.Generator().manual_seed(0)
    for layer_idx, layer in enumerate(model.model.layers):
        for module, lin in [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                            ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]:
            x = torch.randn(len(names), lin.in_features, generator=g)
            base = x @ lin.weight.T
            assert punica.use_triton(x) == force_triton
            m.prepare_step(token_slots)
            y = lin(x)
            expected = base.clone()
            for t, n in enumerate(names):
                if n is not None:
                    expected[t] += x[t] @ _dense_delta(deltas[n], layer_idx, module, lin).T
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
            # A no-LoRA step: exactly the base output, with adapters still loaded.
            m.prepare_step([-1] * len(names))
            assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))


def test_mixed_batch_reference(mcfg, setup, monkeypatch):
    _run(mcfg, setup, monkeypatch, force_triton=False)


def test_mixed_batch_triton_interpreted(mcfg, setup, monkeypatch):
    pytest.importorskip("triton")
    _run(mcfg, setup, monkeypatch, force_triton=True)


def test_no_lora_launches_nothing(mcfg, setup, monkeypatch):
    paths, _ = setup
    model = FakeLlama(mcfg)
    m = LoRAManager(model, paths, max_loras=2, max_lora_rank=8, max_num_tokens=8,
                    device="cpu", dtype=torch.float32)
    m.acquire("y")
    monkeypatch.setattr(punica, "add_lora", lambda *a: pytest.fail("LoRA op launched"))
    m.prepare_step([-1, -1, -1])
    lin = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, lin.in_features)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
