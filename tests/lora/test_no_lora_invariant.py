"""The no-LoRA invariant at the model level: with LoRA enabled and no adapter row in a step, the
forward pass reads no LoRA weight and calls no LoRA op.

Every LoRA tensor of every hook (A rows of the stacked weights, B, the bias tail) is poisoned
with NaN, and the LoRA ops raise if called; base-only requests must still give exactly the
tokens of the LoRA-disabled engine (a NaN read anywhere would change them), and one prefill
step and one decode step of base rows exactly its logits. A row with an adapter in the same
poisoned engine does get NaN logits, so the poison would show if a base step read it.
"""
import pytest
import torch

import batchrun.engine.model_runner as model_runner
import batchrun.engine.models.decoder as decoder
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.engine.lora import punica
from tests.helpers.adapters import parity_adapter
from tests.helpers.models import random_prompts, save_hf_model


def _forbidden(*a, **k):
    raise AssertionError("a LoRA op ran in a step without adapter rows")


# every family: Qwen3 (q/k norms: qkv's delta is added in the projection), Gemma 2 (its norms
# take the deltas), Phi-3 (fused adapters), Mixtral and Qwen3-MoE (all-linear is also LoRA on
# the routers and experts there: lora/experts.py); and an FP8 base (its adapters' A rows apart)
@pytest.mark.parametrize("variant", ["llama3_gqa", "qwen3", "gemma2", "phi3_longrope", "mixtral",
                                     "qwen3_moe", "llama3_gqa+fp8"])
@pytest.mark.parametrize("path", ["unfused", "fused_ref"])  # CPU path; GPU decode plumbing
def test_base_rows_never_touch_lora(tmp_path, path, variant, monkeypatch):
    if path == "fused_ref":
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    variant, fp8 = variant.split("+")[0], variant.endswith("+fp8")
    base = save_hf_model(variant, tmp_path / "base")
    # peft gives an MoE's stacked gate_up_proj twice the rank: 2 x 4 fits max_lora_rank 8
    r = 4 if variant in ("mixtral", "qwen3_moe") else 8
    parity_adapter(variant, tmp_path / "all", 7, dict(r=r, lora_alpha=2 * r, target_modules="all-linear"))
    prompts = random_prompts(6, [5, 17, 40, 3, 29, 11], base.config.vocab_size, seed=5)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(model=str(tmp_path / "base"), device="cpu", max_model_len=128, max_num_batched_tokens=32,
              quantization="fp8" if fp8 else None)

    plain = Engine.from_config(EngineConfig(**kw))
    want = [r.output_token_ids for r in plain.generate([Request(i, p, sp) for i, p in enumerate(prompts)])]

    engine = Engine.from_config(EngineConfig(**kw, enable_lora=True, max_loras=2, max_lora_rank=8),
                                adapters={"all": str(tmp_path / "all")})
    hooks = list(engine.lora.hooks.values())
    assert hooks
    with torch.no_grad():
        for h in hooks:
            h.lora_a.fill_(float("nan"))
            h.lora_b.fill_(float("nan"))
            if h.bias_full is not None:
                h.bias_full[h.slice_offsets[-1]:].fill_(float("nan"))  # past the N base outputs
    monkeypatch.setattr(punica, "add_lora", _forbidden)
    monkeypatch.setattr(LoRADelta, "__init__", _forbidden)
    monkeypatch.setattr(decoder, "moe_with_lora", _forbidden)
    monkeypatch.setattr(decoder, "lora_delta", _forbidden)
    got = [r.output_token_ids for r in engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])]
    assert got == want
    assert all(torch.isnan(h.lora_a).all() for h in hooks)  # the poison was really in place


# ---- one prefill step and one decode step, logits compared --------------------------------
def _poison(engine) -> None:
    with torch.no_grad():
        for h in engine.lora.hooks.values():
            h.lora_a.fill_(float("nan"))
            h.lora_b.fill_(float("nan"))
            if h.bias_full is not None:
                h.bias_full[h.slice_offsets[-1]:].fill_(float("nan"))  # past the N base outputs


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(LoRA-disabled engine, LoRA engine with NaN-poisoned stacks), CPU, eager."""
    root = tmp_path_factory.mktemp("invariant")
    save_hf_model("qwen2_bias", root / "base")  # q/k/v biases: the bias tail is poisoned too
    parity_adapter("qwen2_bias", root / "all", 3, dict(r=8, lora_alpha=16, target_modules="all-linear"))
    kw = dict(model=str(root / "base"), device="cpu", max_model_len=128, max_num_batched_tokens=128)
    plain = Engine.from_config(EngineConfig(**kw))
    lora = Engine.from_config(EngineConfig(**kw, enable_lora=True, max_loras=2, max_lora_rank=8),
                              adapters={"all": str(root / "all")})
    assert lora.lora.hooks and lora.runner.graphs is None
    # load the adapter into its slot first (it stays resident: loading it again later would
    # overwrite the poison), then poison every slot
    lora.lora.acquire("all")
    lora.lora.release("all")
    _poison(lora)
    return plain, lora


PROMPTS = random_prompts(4, [9, 23, 4, 15], 128, seed=11)


def _one_prefill_one_decode(engine, adapters: list[str | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits of one prefill step over PROMPTS (row i runs adapters[i]) and of the decode
    step after it (every row fed token 7)."""
    sched = Scheduler(engine.config, engine.blocks, engine.lora)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for i, (p, a) in enumerate(zip(PROMPTS, adapters)):
        sched.add(Sequence(i, f"r{i}", p, sp, a, None))
    try:
        batch = sched.schedule()
        assert batch.is_prefill and len(batch.seqs) == len(PROMPTS)
        prefill = engine.runner.prefill(batch)
        assert batch.sampled == list(range(len(PROMPTS)))
        n = len(batch.seqs)
        sched.update(batch.seqs, [7] * n, [None] * n, [None] * n)
        batch = sched.schedule()
        assert not batch.is_prefill and sorted(s.index for s in batch.seqs) == list(range(len(PROMPTS)))
        order = [s.index for s in batch.seqs]  # LoRA rows are sorted by slot: back to PROMPTS order
        decode = engine.runner.decode(batch)[torch.tensor([order.index(i) for i in range(n)])]
        return prefill.clone(), decode.clone()
    finally:
        for seq in list(sched.running):
            sched.finish(seq, "length")


@pytest.mark.parametrize("path", ["unfused", "fused_ref"])
def test_base_step_logits_equal_the_lora_disabled_model(engines, path, monkeypatch):
    plain, lora = engines
    if path == "fused_ref":  # the GPU plumbing: fused decode and fused (small) prefill steps
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    want_prefill, want_decode = _one_prefill_one_decode(plain, [None] * len(PROMPTS))
    with monkeypatch.context() as m:
        m.setattr(punica, "add_lora", _forbidden)
        m.setattr(LoRADelta, "__init__", _forbidden)
        got_prefill, got_decode = _one_prefill_one_decode(lora, [None] * len(PROMPTS))
    assert torch.isfinite(want_prefill).all() and torch.isfinite(want_decode).all()
    assert torch.equal(got_prefill, want_prefill)
    assert torch.equal(got_decode, want_decode)


@pytest.mark.parametrize("path", ["unfused", "fused_ref"])
def test_adapter_row_reads_the_poison(engines, path, monkeypatch):
    """The check above can fail: a step with an adapter row reads the NaN stacks."""
    _, lora = engines
    if path == "fused_ref":
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    prefill, decode = _one_prefill_one_decode(lora, [None, "all", None, None])
    assert torch.isnan(prefill[1]).all() and torch.isnan(decode[1]).all()
