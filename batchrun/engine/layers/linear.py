"""Linear layers with fused output slices and a LoRA hook.

A fused layer (q/k/v, gate/up) holds one weight of shape [sum(output_sizes), in_features];
`output_sizes` tells LoRA where each slice starts. LoRA is attached by setting `lora` to a hook
(batchrun.engine.lora.layer.LoRALinear) with
`forward(linear, x, lora_step, kernel, defer) -> (y, delta)`. The hook runs only when the step
has LoRA tokens (`step.lora` is not None): a step without adapters runs exactly the base
matmul, whatever hooks are attached (and a graph captured for it holds exactly the base
kernels).

The matmul is layers/gemm.py's `project`, in the kernel the step plan names for this layer's
kind (`step.gemm`, keyed by `name`); an FP8 Linear (`quant` set, layers/fp8.py) runs its
scaled FP8 GEMM.

`defer=True` is for callers whose next op can fuse a LoRA delta (rotary, RMSNorm, SiLU-and-mul
take a `lora=` argument): they get `(y, delta)` where delta is a LoRADelta to pass on, or None
when there is nothing left to add (no LoRA this step, or the hook already added it to y).
"""
from __future__ import annotations

import torch
from torch import nn

from batchrun.engine.layers.gemm import project
from batchrun.engine.layers.step import GEMM_KINDS, Step


class Linear(nn.Module):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 name: str = ""):
        super().__init__()
        if name not in GEMM_KINDS:
            raise ValueError(f"Linear name must be one of {GEMM_KINDS} (the step plan's "
                             f"projection kinds), got {name!r}")
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.name = name  # "qkv_proj", "o_proj", "gate_up_proj", "down_proj"
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features), requires_grad=False)
                     if bias else None)
        self.lora = None  # set by batchrun.engine.lora (LoRALinear)
        # FP8 (layers/fp8.py make_fp8): the scheme, and the weight's and input's scales
        self.quant = None
        self.weight_scale = None
        self.input_scale = None

    def forward(self, x: torch.Tensor, step: Step, defer: bool = False):
        # x: [T, in_features] -> y: [T, out_features], or (y, LoRADelta | None) with defer
        kernel = step.gemm.of(self.name)
        if self.lora is None or step.lora is None:
            y, delta = project(self, x, kernel), None
        else:
            y, delta = self.lora.forward(self, x, step.lora, kernel, defer)
        return (y, delta) if defer else y
