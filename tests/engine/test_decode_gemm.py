"""experiments.triton_decode_gemm: steps of at most 16 rows run their projections and lm_head in the
Triton skinny GEMM (SiLU fused into gate/up), bigger steps and small weights stay on torch's GEMM, LoRA steps
stream [W; A] through it (gate_up: W, with the norm's shrink), and the tokens are those of the
engine without it.

CPU, fp16, every Triton kernel of the GPU path under the interpreter (BATCHRUN_FORCE_TRITON);
MIN_WEIGHT_ELEMENTS is lowered so the tiny model's projections qualify (its o_proj is kept out
to check the size rule)."""
import collections

import pytest

import batchrun.engine.step_plan as step_plan
import batchrun.kernels.skinny_gate_up_silu as fused_kernel
import batchrun.kernels.skinny_gemm as skinny_kernel
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.envs import Experiments
from batchrun.engine.request import Request
from tests.helpers.adapters import save_peft_adapters
from tests.helpers.models import random_prompts, save_hf_model

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # every test runs whole engines with interpreted kernels


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_gemm")
    save_hf_model("qwen2_bias", root / "base")  # qkv has a bias
    adapters = save_peft_adapters(root, ["a", "b"], variant="qwen2_bias",
                                  targets=("q_proj", "v_proj", "gate_proj", "down_proj", "o_proj"))
    return root, adapters


@pytest.fixture(scope="module")
def reference():
    # the engine without the Triton GEMM, run once per `lora` for the module's tests on `dirs`
    # (each run is ~20 s of interpreted kernels)
    cache = {}

    def get(dirs, lora):
        if lora not in cache:
            with pytest.MonkeyPatch.context() as m:
                cache[lora] = _run(m, dirs, decode_gemm=False, lora=lora)[:2]
        return cache[lora]
    return get


def _run(monkeypatch, dirs, decode_gemm: bool, lora: bool):
    root, adapters = dirs
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    import batchrun.engine.model_runner as model_runner
    monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    engine = Engine.from_config(
        EngineConfig(model=str(root / "base"), device="cpu", dtype="float16", max_model_len=96,
                     max_num_seqs=24, max_num_batched_tokens=256, enable_lora=lora, max_loras=2,
                     max_lora_rank=4,
                     experiments=Experiments(triton_decode_gemm=decode_gemm)),
        adapters if lora else None)
    o_proj = engine.model.model.layers[0].self_attn.o_proj.weight.numel()
    monkeypatch.setattr(step_plan, "MIN_WEIGHT_ELEMENTS", o_proj + 1)  # o_proj (the smallest) stays out
    calls = collections.Counter()
    for mod, name in ((skinny_kernel, "skinny_gemm"), (fused_kernel, "skinny_gate_up_silu")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda x, w, *a, _o=orig, _n=name, **k: (
            calls.update([(_n, x.shape[0] <= 16, w.shape[0], k.get("lora") is not None)]),
            _o(x, w, *a, **k))[-1])
    # 20 rows: the prefill and first decode step have 20 rows (torch's GEMM), the later decode
    # steps 16, 12, 8, 4 (Triton); rows i, i + 5, .. run equally long, so every one of those
    # steps has rows of each adapter and base rows
    prompts = random_prompts(20, [5, 11, 3, 8], engine.model.config.vocab_size, seed=4)
    names = [None, "a", "b", None] if lora else [None]
    reqs = [Request(i, p, SamplingParams(max_tokens=2 + i % 5, ignore_eos=True),
                    adapter=names[i % len(names)]) for i, p in enumerate(prompts)]
    tokens = {r.request_id: r.output_token_ids for r in engine.generate(reqs)}
    return tokens, calls, engine


@pytest.mark.parametrize("lora", [False, True])
def test_few_row_steps_take_the_triton_gemm_with_the_same_tokens(monkeypatch, dirs, reference,
                                                                lora):
    ref, ref_calls = reference(dirs, lora)
    got, calls, engine = _run(monkeypatch, dirs, decode_gemm=True, lora=lora)
    assert not ref_calls  # off: never
    assert got == ref
    cfg = engine.model.config
    q_kv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert all(small for (_, small, _, _) in calls), calls  # only steps of <= 16 rows
    plain = {n for (k, _, n, _) in calls if k == "skinny_gemm"}
    fused = {(n, d) for (k, _, n, d) in calls if k == "skinny_gate_up_silu"}
    I2 = 2 * cfg.intermediate_size
    if not lora:  # qkv, down, lm_head; gate_up always with its SiLU; o_proj below the size rule
        assert plain == {q_kv, cfg.hidden_size, cfg.vocab_size}, calls
        assert fused == {(I2, False)}, calls
    else:  # LoRA steps stream [W; A] (rows past N) for qkv and down; gate_up streams W alone
        # with the delta in its epilogue (the shrink from the norm before)
        assert any(n > q_kv for n in plain) and any(cfg.hidden_size < n < q_kv for n in plain)
        assert (I2, True) in fused and {n for n, _ in fused} == {I2}, calls
    assert sum(calls.values()) > 0


def test_lora_gate_up_shrink_with_the_residual_add(monkeypatch, tmp_path):
    # adapters on up_proj only: o_proj has no hook, so the post-attention norm adds the residual
    # itself (in chunks, into a new residual tensor) while it computes gate_up's shrink
    save_hf_model("qwen2_bias", tmp_path / "base")
    adapters = save_peft_adapters(tmp_path, ["a", "b"], variant="qwen2_bias", targets=("up_proj",))
    with monkeypatch.context() as m:
        ref, _, _ = _run(m, (tmp_path, adapters), decode_gemm=False, lora=True)
    got, calls, engine = _run(monkeypatch, (tmp_path, adapters), decode_gemm=True, lora=True)
    assert engine.model.model.layers[0].self_attn.o_proj.lora is None
    assert got == ref
    assert any(k == "skinny_gate_up_silu" and d for (k, _, _, d) in calls), calls
