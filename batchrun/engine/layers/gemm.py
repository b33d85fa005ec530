"""The GEMMs a projection runs, by the name the step plan gives (engine/step_plan.py chooses,
layers/step.py's GemmPlan carries the choice): None = cuBLAS (F.linear), "skinny" = batchrun's
Triton GEMM that only streams the weight (kernels/skinny_gemm.py), "skinny_split" = the same
with K split over programs, tuned per weight shape; for gate_up with SiLU-and-mul in its
epilogue, kernels/skinny_gate_up_silu.py.

The result differs from cuBLAS's by at most rounding (an ulp where cuBLAS splits K), as any two
GEMMs do.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from batchrun.kernels.lora_meta import LoRADelta


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, kernel: str | None) -> Tensor:
    # x [T, K] @ weight [N, K].T (+ bias) -> [T, N]; kernel: the step plan's GemmPlan entry
    if kernel == "skinny":
        from batchrun.kernels.skinny_gemm import skinny_gemm
        return skinny_gemm(x, weight, bias)
    if kernel == "skinny_split":  # tuned per weight shape: the [W; A] of a LoRA step takes W's
        from batchrun.kernels.skinny_gemm import skinny_gemm, split_config_for
        config, split_k = split_config_for(weight.shape[0], weight.shape[1])
        return skinny_gemm(x, weight, bias, config=config, split_k=split_k)
    if kernel is not None:
        raise ValueError(f"unknown GEMM kernel {kernel!r}: skinny, skinny_split or None")
    return F.linear(x, weight, bias)


def linear_lora(x: Tensor, w_full: Tensor, bias: Tensor | None, n_out: int, lora_b: Tensor,
                token_slots: Tensor) -> Tensor:
    """A fused LoRA step's one-slice projection whose W takes "skinny_split": x @ [W; A].T and
    the delta in one launch (kernels/skinny_gemm.skinny_gemm_lora), [T, n_out] with the delta
    added; W's columns are those of the plain split GEMM (the same tiles and K split)."""
    from batchrun.kernels.skinny_gemm import skinny_gemm_lora, split_config_for
    config, split_k = split_config_for(w_full.shape[0], w_full.shape[1])
    return skinny_gemm_lora(x, w_full, n_out, lora_b, token_slots, bias, config=config,
                            split_k=split_k)


def gate_up_silu(x: Tensor, weight: Tensor, lora: LoRADelta | None = None) -> Tensor:
    # x [T <= 16, K], the gate_up weight [2I, K] -> silu(gate) * up [T, I], one launch;
    # lora: gate_up's delta (its shrink computed by the norm before), added before the SiLU
    from batchrun.kernels.skinny_gate_up_silu import skinny_gate_up_silu
    return skinny_gate_up_silu(x, weight, lora=lora)
