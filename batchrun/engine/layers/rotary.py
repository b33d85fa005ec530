"""Rotary position embedding (HF "rotate_half" layout), with llama3 frequency scaling.

cos/sin are precomputed in fp32 for all positions up to max_position and indexed by the
step's position ids, so the op has static shapes for graph capture.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.reference import ref_rotary
from batchrun.engine.layers.backend import use_triton
from batchrun.engine.layers.attention import KVWrite


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # llama3: long wavelengths are divided by `factor`, short ones kept, smooth blend between
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin", torch.empty(max_position, head_dim), persistent=False)

    @torch.no_grad()
    def init_cache(self, device) -> None:
        """Fill cos/sin (called after the module is materialised from the meta device)."""
        inv_freq = inv_frequencies(self.head_dim, self.theta, self.scaling).to(device)
        t = torch.arange(self.max_position, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [P, D] fp32

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                lora: LoRADelta | None = None, cache: KVWrite | None = None):
        # positions: [T]; q: [T, Hq, D]; k, v: [T, Hkv, D] -> (rotated q, rotated k, v).
        # lora: the qkv projection's pending LoRA delta, added to q, k, v first.
        # cache: where this step's K/V go (PagedAttention.kv_write). On CUDA one Triton kernel
        # works in place (q, k, v may be strided views of the qkv output) and, given `cache`,
        # writes rotated k and v into the paged cache itself and returns (q, None, None): the
        # attention then has nothing left to write. On CPU the torch reference returns new
        # tensors (HF op order, same rounding) and the attention writes the cache.
        if use_triton(q):
            if cache is not None:
                from batchrun.kernels.rotary import apply_rotary_into_cache
                q = apply_rotary_into_cache(q, k, v, self.cos_sin, positions, cache.k_cache,
                                            cache.v_cache, cache.slot_mapping, lora=lora)
                return q, None, None
            from batchrun.kernels.rotary import apply_rotary
            q, k = apply_rotary(q, k, self.cos_sin, positions, v=v, lora=lora)
            return q, k, v
        if lora is not None:
            T = q.shape[0]
            qkv = lora.apply_reference(torch.cat([t.reshape(T, -1) for t in (q, k, v)], dim=1))
            q, k, v = (t.view_as(o) for t, o in zip(
                qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1), (q, k, v)))
        return ref_rotary(q, self.cos_sin, positions), ref_rotary(k, self.cos_sin, positions), v
