"""Linear layers with fused output slices and a LoRA hook.

A fused layer (q/k/v, gate/up) holds one weight of shape [sum(output_sizes), in_features];
`output_sizes` tells LoRA where each slice starts. LoRA is attached by setting `lora` to a hook
(batchrun.engine.lora.layer.LoRALinear) with `forward(linear, x, lora_step, defer) -> (y, delta)`.
The hook runs only when the step has LoRA tokens (`lora_step`, the step's `Step.lora`, is not
None): a step without adapters runs exactly the base matmul, whatever hooks are attached (and a
graph captured for it holds exactly the base kernels).

The matmul itself is layers/gemm.py's `linear`: cuBLAS, or on steps of at most 16 rows the Triton
GEMM that only streams the weight, when `decode_gemm` is on (EngineConfig.triton_decode_gemm).

`defer=True` is for callers whose next op can fuse a LoRA delta (rotary, RMSNorm, SiLU-and-mul
take a `lora=` argument): they get `(y, delta)` where delta is a LoRADelta to pass on, or None
when there is nothing left to add (no LoRA this step, or the hook already added it to y).
"""
from __future__ import annotations

import torch
from torch import nn

from batchrun.engine.layers.gemm import gemm_kernel, linear, takes_skinny
from batchrun.engine.layers.step import LoRAStep


class Linear(nn.Module):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 name: str = ""):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.name = name  # "qkv_proj", "o_proj", "gate_up_proj", "down_proj"
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features), requires_grad=False)
                     if bias else None)
        self.lora = None  # set by batchrun.engine.lora (LoRALinear)
        self.decode_gemm = False  # layers/gemm.set_decode_gemm

    def skinny(self, x: torch.Tensor) -> bool:
        # whether x @ weight.T runs in the Triton skinny GEMM (a LoRA step's [W; A] too)
        return takes_skinny(self.decode_gemm, x, self.weight)

    def kernel(self, x: torch.Tensor) -> str | None:
        # the GEMM x @ weight.T runs in (layers/gemm.py's gemm_kernel; a LoRA step's [W; A] too)
        return gemm_kernel(self.decode_gemm, x, self.weight)

    def forward(self, x: torch.Tensor, lora_step: LoRAStep | None = None, defer: bool = False):
        # x: [T, in_features] -> y: [T, out_features], or (y, LoRADelta | None) with defer
        if self.lora is None or lora_step is None:
            y, delta = linear(x, self.weight, self.bias, self.kernel(x)), None
        else:
            y, delta = self.lora.forward(self, x, lora_step, defer)
        return (y, delta) if defer else y
