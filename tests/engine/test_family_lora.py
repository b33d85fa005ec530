"""Every family with PEFT adapters on every linear layer (`all-linear`) and on a few modules, mixed
with base rows in one job: greedy tokens equal transformers + peft's, on the CPU engine's path
(shrink + expand in each projection) and on the GPU's decode plumbing with the torch references
(each projection hands its delta to the next op: rotary, norms, activation)."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from tests.helpers.adapters import assert_results_match_peft, parity_adapter
from tests.helpers.models import random_prompts, save_hf_model

NEW = 8
# per family: a few modules, as peft names them in the family's transformers class
SUBSET = {"phi3": ["qkv_proj", "down_proj"]}
FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3_longrope", "phi3_window", "qwen2_window"]


@pytest.mark.parametrize("path", ["unfused", "fused_ref"])
@pytest.mark.parametrize("variant", FAMILIES)
def test_family_lora_matches_peft(tmp_path, variant, path, monkeypatch):
    import batchrun.engine.model_runner as model_runner
    if path != "unfused":
        monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    check_family_lora(tmp_path, variant, "cpu")


# every Triton kernel of the GPU path under the interpreter: Qwen3's qkv delta through
# kernels/add_lora_delta.py before the per-head norms, Gemma's GeGLU and (1 + w) norms with deltas
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3", "gemma2"])
def test_family_lora_on_the_triton_kernels(tmp_path, variant, monkeypatch):
    import batchrun.engine.model_runner as model_runner
    pytest.importorskip("triton")
    monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    check_family_lora(tmp_path, variant, "cpu")


def check_family_lora(tmp_path, variant: str, device: str) -> None:
    """The engine on `device` (fp32) against transformers + peft (CPU) for base rows and two
    adapters of `variant` mixed in one generate."""
    base = save_hf_model(variant, tmp_path / "base")
    family = base.config.model_type
    kws = {"all": dict(r=8, lora_alpha=16, target_modules="all-linear"),
           "some": dict(r=4, lora_alpha=8,
                        target_modules=SUBSET.get(family, ["k_proj", "o_proj", "up_proj"]))}
    paths = {}
    for i, (name, kw) in enumerate(kws.items()):
        paths[name] = tmp_path / name
        parity_adapter(variant, paths[name], 200 + i, kw)
    names = [None, "all", "some", None, "all", "some", "all"]
    # prompts longer than the window (48) and the LongRoPE pretraining length (64)
    prompts = random_prompts(len(names), [5, 70, 17, 90, 3], base.config.vocab_size, seed=4)
    engine = Engine.from_config(
        EngineConfig(model=str(tmp_path / "base"), device=device, dtype="float32", max_model_len=256,
                     max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8),
        adapters={n: str(p) for n, p in paths.items()})
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    results = engine.generate([Request(i, p, sp, adapter=n)
                               for i, (p, n) in enumerate(zip(prompts, names))])
    assert_results_match_peft(variant, base, paths, prompts, names, results, NEW)
