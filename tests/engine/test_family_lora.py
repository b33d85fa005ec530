"""Every family with PEFT adapters on every linear layer (`all-linear`) and on a few modules, mixed
with base rows in one job: greedy tokens equal transformers + peft's, on the CPU engine's path
(shrink + expand in each projection) and on the GPU's decode plumbing with the torch references
(each projection hands its delta to the next op: rotary, norms, activation)."""
import pytest

from tests.helpers.adapters import check_mixed_with_peft

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
    """`all-linear` and a few modules of `variant`, mixed with base rows (helpers/adapters.py)."""
    def adapters(base):
        family = base.config.model_type
        return {"all": dict(r=8, lora_alpha=16, target_modules="all-linear"),
                "some": dict(r=4, lora_alpha=8,
                             target_modules=SUBSET.get(family, ["k_proj", "o_proj", "up_proj"]))}
    check_mixed_with_peft(tmp_path, variant, adapters, device, seed=200)
