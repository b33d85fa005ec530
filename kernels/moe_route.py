"""A mixture-of-experts router's weights and experts from its logits, one kernel.

logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k]), as the families define it
(kernels/reference.py ref_moe_route): softmax over all E experts in fp32, the k largest
probabilities in descending order, then optionally divided by their sum (Mixtral always,
Qwen3-MoE per norm_topk_prob) and optionally rounded to the model's dtype and back (the Qwen MoE
routers). In torch that is 5-7 small launches a layer (cast, softmax, topk, sum, divide, two
casts); a decode step of a 48-layer MoE pays them as ~300 kernel boundaries.

One program per token row holds the row's E logits in registers (E <= 1024): the softmax, then k
rounds of "largest remaining, lowest index on a tie, masked out". Grid from static shapes:
CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from batchrun.kernels.pdl import pdl_enter, pdl_kwargs
from batchrun.kernels.utils import FLOAT_DTYPES, check

MAX_EXPERTS = 1024  # one row of logits in one program's registers


@triton.jit
def _moe_route_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l, stride_w, stride_i,
                      TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      NORM: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(mask, p, -1.0)  # probabilities are >= 0: a masked column is never chosen
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx.to(tl.int64), ids)
        p = tl.where(offs == idx, -1.0, p)
    if NORM:
        weights = weights / tl.sum(weights, axis=0)
    if ROUND:  # to the model's dtype (the output's element type) and back
        weights = weights.to(logits_ptr.dtype.element_ty).to(tl.float32)
    keep = slots < TOP_K
    tl.store(w_ptr + row * stride_w + slots, weights, mask=keep)
    tl.store(ids_ptr + row * stride_i + slots, ids, mask=keep)


def moe_route(logits: Tensor, top_k: int, norm_topk_prob: bool, round_to: torch.dtype | None
              ) -> tuple[Tensor, Tensor]:
    # logits [T, E] (the router's output, in the model's dtype) -> (weights fp32 [T, k],
    # ids int64 [T, k]); round_to: None, or the logits' dtype (the Qwen MoE routers round the
    # weights to the model's dtype)
    check(logits.dim() == 2 and logits.dtype in FLOAT_DTYPES and logits.stride(1) == 1,
          f"moe_route needs logits [T, E] float with contiguous rows, got "
          f"{tuple(logits.shape)} {logits.dtype}")
    T, E = logits.shape
    check(1 <= top_k <= E <= MAX_EXPERTS,
          f"moe_route takes 1 <= top_k ({top_k}) <= experts ({E}) <= {MAX_EXPERTS}")
    check(round_to is None or round_to == logits.dtype,
          f"moe_route rounds the weights to the logits' dtype ({logits.dtype}), not {round_to}")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    _moe_route_kernel[(T,)](
        logits, weights, ids, E, logits.stride(0), weights.stride(0), ids.stride(0),
        TOP_K=top_k, BLOCK_E=max(16, triton.next_power_of_2(E)),
        BLOCK_K=max(2, triton.next_power_of_2(top_k)), NORM=norm_topk_prob,
        ROUND=round_to is not None, num_warps=4 if E > 256 else 1, **pdl_kwargs(logits))
    return weights, ids
