"""The no-LoRA invariant at the model level: with LoRA enabled and no adapter row in a step, the
forward pass reads no LoRA weight and calls no LoRA op.

Every LoRA tensor of every hook (A rows of the stacked weights, B, the bias tail) is poisoned
with NaN, and the LoRA ops raise if called; base-only requests must still give exactly the
tokens of the LoRA-disabled engine (a NaN read anywhere would change them).
"""
import pytest
import torch

import batchrun.engine.model_runner as model_runner
from batchrun.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.lora import punica
from tests.lora.test_engine_parity import _make_adapter
from tests.tiny_models import random_prompts, save_hf_model


def _forbidden(*a, **k):
    raise AssertionError("a LoRA op ran in a step without adapter rows")


@pytest.mark.parametrize("path", ["unfused", "fused_ref"])  # CPU path; GPU decode plumbing
def test_base_rows_never_touch_lora(tmp_path, path, monkeypatch):
    if path == "fused_ref":
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    base = save_hf_model("llama3_gqa", tmp_path / "base")
    _make_adapter("llama3_gqa", tmp_path / "all", 7, dict(r=8, lora_alpha=16, target_modules="all-linear"))
    prompts = random_prompts(6, [5, 17, 40, 3, 29, 11], base.config.vocab_size, seed=5)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    kw = dict(model=str(tmp_path / "base"), device="cpu", max_model_len=128, max_num_batched_tokens=32)

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
    got = [r.output_token_ids for r in engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])]
    assert got == want
    assert all(torch.isnan(h.lora_a).all() for h in hooks)  # the poison was really in place
