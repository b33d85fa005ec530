"""The routed experts of a mixture-of-experts block: route, then run each token's top-k experts.

`route` is the router's math as the families define it (softmax over every expert in fp32, the
top k, then each family's normalisation), in torch ops with no host synchronisation, so a
decode step that runs it can be captured in a CUDA graph. `fused_moe` runs the experts: the
Triton kernel on CUDA (kernels/fused_moe.py), the torch reference elsewhere; both compute
kernels/reference.py's `ref_fused_moe`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from batchrun.engine.layers.backend import use_triton
from batchrun.kernels.reference import ref_fused_moe


def route(logits: Tensor, top_k: int, norm_topk_prob: bool,
          round_to: torch.dtype | None) -> tuple[Tensor, Tensor]:
    # logits: the router's [T, E] -> (top-k weights fp32 [T, k], expert ids int64 [T, k]).
    # round_to: the dtype the family rounds the weights to (Qwen MoE: the model's), or None
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_to is not None:
        weights = weights.to(round_to).float()
    return weights, ids


def fused_moe(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
              topk_ids: Tensor, activation: str = "silu") -> Tensor:
    # x: [T, H]; w_gate_up: [E, 2I, H]; w_down: [E, H, I]; topk_weights: fp32 [T, k];
    # topk_ids: int [T, k] -> [T, H] (kernels/reference.py's ref_fused_moe is the definition)
    if use_triton(x):
        from batchrun.kernels.fused_moe import fused_moe as triton_fused_moe
        return triton_fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
    return ref_fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids, activation)
