"""Turn fp32 logits into next tokens: greedy, temperature, top-k, top-p, per-row seeds.

Sampled rows use the Gumbel-max form (argmax of probs / Exp(1) noise) with noise drawn from the
row's own generator, so a row's tokens depend only on its seed and its own logits, never on
which rows share the batch.
"""
from __future__ import annotations

import torch

from batchrun.config import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    # logits: [N, V] fp32, one row per sequence to sample
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        probs = _filtered_probs(logits[idx], [params[i] for i in sampled])
        for row, i in enumerate(sampled):
            noise = torch.empty_like(probs[row]).exponential_(generator=generators[i])
            tokens[i] = (probs[row] / noise).argmax()
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # logits: [M, V] -> probabilities after temperature, top-k and top-p
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)
    logits = logits / temp[:, None]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the top token always stays)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)
