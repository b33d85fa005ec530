"""Linear layers with fused output slices and a LoRA hook.

A fused layer (q/k/v, gate/up) holds one weight of shape [sum(output_sizes), in_features];
`output_sizes` tells LoRA where each slice starts. LoRA is attached by setting `lora` to an
object with `apply(x, y)` that adds the adapter delta into y in place; whether it launches any
work is decided by that object from the step's has_lora flag, so a step without adapters runs
exactly the base matmul (and a graph captured for it holds exactly the base kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        self.lora = None  # set by batchrun.lora; must have apply(x: [T, in], y: [T, out]) -> None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> y: [T, out_features]
        y = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y
