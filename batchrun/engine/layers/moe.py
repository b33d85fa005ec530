"""The routed experts of a mixture-of-experts block: route, then run each token's top-k experts.

`route` is the router's math as the families define it (softmax over every expert in fp32, the
top k, then each family's normalisation), in torch ops with no host synchronisation, so a
decode step that runs it can be captured in a CUDA graph. `fused_moe` runs the experts: the
Triton kernel on CUDA (kernels/fused_moe.py), the torch reference elsewhere; both compute
kernels/reference.py's `ref_fused_moe`.

LoRA on the block (lora/experts.py) is a per-(token, expert) delta: `moe_with_lora` adds each
token's adapter delta to its experts' gate_up and down outputs (on CUDA inside the fused
kernel's three launches: kernels/fused_moe.py's `fused_moe_lora`), and `lora_delta` the
router's (torch ops with no host synchronisation, so a LoRA decode graph captures it). Steps
without adapter rows never call them.
"""
from __future__ import annotations

import torch
from torch import Tensor

from batchrun.engine.layers.backend import use_triton
from batchrun.kernels.reference import ref_act_and_mul, ref_fused_moe


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


def lora_delta(x: Tensor, slots: Tensor, a: Tensor, b: Tensor, expert: int = 0) -> Tensor:
    # x: [n, in]; slots: int [n] (-1: no adapter); a: [S, E, R, in], b: [S, E, out, R] (scaling
    # folded in) -> fp32 [n, out]: (x . A[slot, expert]^T) . B[slot, expert]^T, 0 for slot -1
    s = slots.long()
    has = (s >= 0).unsqueeze(1)
    s = s.clamp(min=0)
    shrunk = torch.einsum("ni,nri->nr", x.float(), a[s, expert].float())
    return torch.einsum("nr,nor->no", shrunk, b[s, expert].float()) * has


def moe_with_lora(x: Tensor, w_gate_up: Tensor, w_down: Tensor, topk_weights: Tensor,
                  topk_ids: Tensor, activation: str, slots: Tensor,
                  gate_up: tuple[Tensor, Tensor], down: tuple[Tensor, Tensor]) -> Tensor:
    # fused_moe's result with each token's adapter delta (slots: int [T], -1 none) added to its
    # experts' gate_up and down outputs (each that tensor's (A [S, E, R, in], B [S, E, out, R])
    # slots; zero where no adapter targets it), in fp32 before the one rounding of the
    # projection (kernels/reference.py's ref_fused_moe_lora).
    if use_triton(x):
        from batchrun.kernels.fused_moe import fused_moe_lora
        return fused_moe_lora(x, w_gate_up, w_down, topk_weights, topk_ids, *gate_up, *down,
                              slots, activation)
    # the CPU engine's path: loops over the experts the step routes to (host-synchronising)
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids = topk_ids.to(device=x.device, dtype=torch.long)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        ss = slots[tok]
        h = ref_act_and_mul(_project(x[tok], w_gate_up[e], gate_up, ss, e), activation)
        y = _project(h, w_down[e], down, ss, e)
        out.index_add_(0, tok, y.float() * topk_weights[tok, j].float().unsqueeze(1))
    return out.to(x.dtype)


def _project(x: Tensor, w: Tensor, lora: tuple[Tensor, Tensor], slots: Tensor,
             expert: int) -> Tensor:
    # x [n, K] @ w [N, K]^T, plus expert `expert`'s LoRA delta of each row's slot, in fp32
    # before the one rounding to x's dtype (ref_linear's arithmetic)
    return (x.float() @ w.float().t() + lora_delta(x, slots, *lora, expert)).to(x.dtype)
