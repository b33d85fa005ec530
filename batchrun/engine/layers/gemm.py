"""The GEMMs a projection runs, by the name the step plan gives (engine/step_plan.py chooses,
layers/step.py's GemmPlan carries the choice): None = cuBLAS (F.linear), "skinny" = batchrun's
Triton GEMM that only streams the weight (kernels/skinny_gemm.py); for gate_up with act-and-mul
(SiLU or GELU-tanh) in its epilogue, kernels/skinny_gate_up_silu.py.

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
    if kernel is not None:
        raise ValueError(f"unknown GEMM kernel {kernel!r}: skinny or None")
    return F.linear(x, weight, bias)


def project(layer, x: Tensor, kernel: str | None) -> Tensor:
    """A Linear's own GEMM (without LoRA): FP8 layers run layers/fp8.py's scaled GEMM."""
    if layer.quant is not None:
        from batchrun.engine.layers.fp8 import fp8_linear
        return fp8_linear(x, layer, kernel)
    return linear(x, layer.weight, layer.bias, kernel)


def gate_up_silu(x: Tensor, weight: Tensor, lora: LoRADelta | None = None,
                 activation: str = "silu") -> Tensor:
    # x [T <= 16, K], the gate_up weight [2I, K] -> act(gate) * up [T, I], one launch;
    # activation "silu" or "gelu_tanh"; lora: gate_up's delta (its shrink computed by the norm
    # before), added before the activation
    from batchrun.kernels.skinny_gate_up_silu import skinny_gate_up_silu
    return skinny_gate_up_silu(x, weight, lora=lora, activation=activation)
