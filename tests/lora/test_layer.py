"""The Linear hook: mixed LoRA / no-LoRA batches equal a dense per-row computation using peft's
own deltas; a no-LoRA step is exactly the base output and launches no LoRA op."""
import pytest
import torch

from batchrun.engine.layers.step import Step  # a Linear reads its step's LoRA part
from batchrun.engine.lora import punica
from batchrun.engine.lora.manager import LoRAManager
from batchrun.engine.lora.peft_config import PEFT_MODULES
from tests.helpers.adapters import FakeLlama, make_adapter, peft_deltas

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


def _linears(layer):
    """(module name, Linear) for the four LoRA-able Linears of a layer."""
    return [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
            ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]


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
        for module, lin in _linears(layer):
            x = torch.randn(len(names), lin.in_features, generator=g)
            assert punica.use_triton(x) == force_triton
            step = m.lora_step(token_slots)
            y = lin(x, Step(None, step))
            expected = _expected(lin, x, names, deltas, layer_idx, module)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
            # A no-LoRA step: exactly the base output, with adapters still loaded.
            step = m.lora_step([-1] * len(names))
            assert torch.equal(lin(x, Step(None, step)), torch.nn.functional.linear(x, lin.weight))


def test_mixed_batch_reference(mcfg, setup, monkeypatch):
    _run(mcfg, setup, monkeypatch, force_triton=False)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter is on only without a GPU (conftest); "
                           "test_mixed_batch_cuda covers the kernels there")
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
    step = m.lora_step([-1, -1, -1])
    lin = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, lin.in_features)
    assert torch.equal(lin(x, Step(None, step)), torch.nn.functional.linear(x, lin.weight))


def test_deferred_delta(mcfg, setup):
    """A fused step: the hook's one GEMM gives the base output plus a LoRADelta that, applied by
    the consumer, equals the unfused result; without fusing or without LoRA nothing is left."""
    paths, deltas = setup
    model = FakeLlama(mcfg)
    m = LoRAManager(model, paths, max_loras=3, max_lora_rank=8, max_num_tokens=16,
                    device="cpu", dtype=torch.float32)
    slots = {n: m.acquire(n) for n in ("x", "y", "z")}
    assert slots == {"x": 0, "y": 1, "z": 2} and m.slot_bounds == (1, 3)
    names = [None, "x", "y", "z", None, "y", "x"]
    token_slots = [-1 if n is None else slots[n] for n in names]
    g = torch.Generator().manual_seed(3)
    for layer_idx, layer in enumerate(model.model.layers):
        for module, lin in _linears(layer):
            x = torch.randn(len(names), lin.in_features, generator=g)
            step = m.lora_step(token_slots, fuse=True)
            y, delta = lin(x, Step(None, step), defer=True)
            torch.testing.assert_close(y, x @ lin.weight.T, rtol=1e-5, atol=1e-5)
            assert delta.shrunk.data_ptr() == y.data_ptr() + lin.out_features * 4  # one GEMM
            want = _expected(lin, x, names, deltas, layer_idx, module)
            torch.testing.assert_close(delta.apply_reference(y), want, rtol=1e-5, atol=1e-5)
            assert lin(x, Step(None, step)) is not None and step.fuse  # a plain call still adds it itself
            torch.testing.assert_close(lin(x, Step(None, step)), want, rtol=1e-5, atol=1e-5)
            step = m.lora_step(token_slots, fuse=False)
            y, delta = lin(x, Step(None, step), defer=True)
            assert delta is None
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
            step = m.lora_step([-1] * len(names), fuse=True)
            y, delta = lin(x, Step(None, step), defer=True)
            assert delta is None and torch.equal(y, torch.nn.functional.linear(x, lin.weight))
            # slots below the step's slot bound only: the GEMM stacks just their A rows
            low = [n if n != "y" and n != "z" else None for n in names]  # x is in slot 0
            step = m.lora_step([-1 if n is None else slots[n] for n in low], fuse=True)
            assert step.num_slots == 1
            y, delta = lin(x, Step(None, step), defer=True)
            S = len(lin.output_sizes)
            assert delta.num_slots == 1 and delta.shrunk.shape == (len(names), S * m.rank)
            torch.testing.assert_close(y, x @ lin.weight.T, rtol=1e-5, atol=1e-5)
            want = _expected(lin, x, low, deltas, layer_idx, module)
            torch.testing.assert_close(delta.apply_reference(y), want, rtol=1e-5, atol=1e-5)


def _expected(lin, x, names, deltas, layer_idx, module):
    # fp32 dense reference from the (rounded) weights actually used
    out = x.float() @ lin.weight.float().T
    for t, n in enumerate(names):
        if n is not None:
            d = _dense_delta(deltas[n], layer_idx, module, lin).to(x.device)
            out[t] += x[t].float() @ d.T
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_mixed_batch_cuda(mcfg, setup, dtype):
    paths, deltas = setup
    model = FakeLlama(mcfg, dtype).cuda()
    m = LoRAManager(model, paths, max_loras=3, max_lora_rank=8, max_num_tokens=64,
                    device="cuda", dtype=dtype)
    slots = {n: m.acquire(n) for n in ("y", "z", "x")}
    names = ([None, "x", "y", None, "z", "x", "y", "y", None, "z", "x"] * 5)[:53]
    step = m.lora_step([-1 if n is None else slots[n] for n in names])
    tol = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4}[dtype]
    for layer_idx, layer in enumerate(model.model.layers):
        lin = layer.mlp.gate_up_proj if layer_idx else layer.self_attn.qkv_proj
        module = "gate_up_proj" if layer_idx else "qkv_proj"
        x = torch.randn(len(names), lin.in_features, device="cuda").to(dtype)
        want = _expected(lin, x, names, deltas, layer_idx, module)
        torch.testing.assert_close(lin(x, Step(None, step)).float(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_cuda_graph_replay_after_slot_swap(mcfg, setup):
    """A graph captured with LoRA ops stays right after slots are reloaded and meta rewritten
    (buffers are written in place, never reallocated)."""
    paths, deltas = setup
    dtype, T = torch.float16, 8
    model = FakeLlama(mcfg, dtype).cuda()
    m = LoRAManager(model, paths, max_loras=2, max_lora_rank=8, max_num_tokens=16,
                    device="cuda", dtype=dtype)
    lin = model.model.layers[1].self_attn.qkv_proj
    sx = m.acquire("x")
    x_static = torch.randn(T, lin.in_features, device="cuda").to(dtype)
    step = m.lora_step([sx] * T)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
        lin(x_static, Step(None, step))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = lin(x_static, Step(None, step))

    m.release("x")
    sy, sz = m.acquire("y"), m.acquire("z")  # z takes x's slot
    names = [None, "y", "z", "z", None, "y", "z", None]
    m.lora_step([-1 if n is None else {"y": sy, "z": sz}[n] for n in names])  # rewrites meta in place
    x_static.copy_(torch.randn(T, lin.in_features, device="cuda").to(dtype))
    graph.replay()
    want = _expected(lin, x_static, names, deltas, 1, "qkv_proj")
    torch.testing.assert_close(y_static.float(), want, rtol=2e-2, atol=2e-2)
