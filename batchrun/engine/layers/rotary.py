"""Rotary position embedding (HF "rotate_half" layout), with the frequency scalings of
transformers' rope types: llama3, linear, yarn and longrope (dynamic is the default table
within a model's context: models/config.py).

cos/sin are precomputed in fp32 for all positions up to max_position and indexed by the
step's position ids, so the op has static shapes for graph capture. YaRN's and LongRoPE's
attention factor multiplies the table itself (as transformers multiplies cos and sin), so the
kernels are the same for every rope type. The table has rotary_dim columns: with a partial
rotary (Phi-4-mini) only the first rotary_dim dims of each head rotate.

LongRoPE has two tables, short and long factors: transformers rotates a sequence with the long
one once it is longer than the pretraining length (`original_max_position_embeddings`), all of
its positions (Phi-3 recomputes the cache when a sequence crosses it). Both sit in one table,
long rows after the short ones: the model runner adds `long_offset` to the positions of a
sequence the scheduler marked `long_rope` (engine/scheduler.py recomputes at the crossing).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.reference import ref_rotary
from batchrun.engine.layers.backend import use_triton
from batchrun.engine.layers.attention import KVWrite


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None,
                    long: bool = False) -> torch.Tensor:
    """The rotary_dim / 2 inverse frequencies (head_dim here: the rotated dims); long: LongRoPE's
    long factors instead of its short ones."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "longrope":
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta ** exponents)
    if kind == "linear":  # positions divided by factor = frequencies divided by it
        return inv_freq / scaling["factor"]
    if kind == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
    assert kind == "llama3", kind
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


def _yarn_frequencies(dim: int, theta: float, s: dict) -> torch.Tensor:
    # YaRN (arXiv 2309.00071), as transformers computes it: dimensions that rotate fewer than
    # beta_slow times over the pretraining length are interpolated (divided by factor), those
    # that rotate more than beta_fast times kept, a linear ramp between
    factor, original = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by: 1, or YaRN's or LongRoPE's (given, or derived
    from the scaling factor as transformers derives it)."""
    if scaling is None or scaling["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if scaling["rope_type"] == "longrope":
        factor = scaling["factor"]
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.rotary_dim = rotary_dim  # the rotated dims of a head (head_dim unless partial)
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        longrope = scaling is not None and scaling["rope_type"] == "longrope"
        # LongRoPE: rows [P, 2P) hold the long-factor table
        self.long_from = scaling["original_max_position_embeddings"] if longrope else None
        self.long_offset = max_position if longrope else 0
        rows = max_position * (2 if longrope else 1)
        self.register_buffer("cos_sin", torch.empty(rows, rotary_dim), persistent=False)

    @torch.no_grad()
    def init_cache(self, device) -> None:
        """Fill cos/sin (called after the module is materialised from the meta device)."""
        t = torch.arange(self.max_position, device=device, dtype=torch.int64).float()
        scale = attention_factor(self.scaling)
        tables = []
        for long in ((False, True) if self.long_from is not None else (False,)):
            inv_freq = inv_frequencies(self.rotary_dim, self.theta, self.scaling, long).to(device)
            freqs = torch.outer(t, inv_freq)  # [P, R/2]
            tables.append(torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1))  # [P, R]
        self.cos_sin = torch.cat(tables)  # fp32

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                lora: LoRADelta | None = None, cache: KVWrite | None = None):
        # positions: [T]; q: [T, Hq, D]; k, v: [T, Hkv, D] -> (rotated q, rotated k, v).
        # lora: the qkv projection's pending LoRA delta, added to q, k, v first.
        # self.cos_sin [P, R] may be narrower than the head (partial rotary, R < D): the kernels
        # and ref_rotary take the rotary dim from its width and pass dims R.. through.
        # cache: where this step's K/V go (PagedAttention.kv_write). On CUDA one Triton kernel
        # works in place (q, k, v may be strided views of the qkv output) and, given `cache`,
        # writes rotated k and v into the paged cache itself and returns (q, None, None): the
        # attention then has nothing left to write. On CPU the torch reference returns new
        # tensors (HF op order, same rounding) and the attention writes the cache.
        if use_triton(q):
            if cache is not None:
                from batchrun.kernels.rotary import apply_rotary_into_cache
                q = apply_rotary_into_cache(q, k, v, self.cos_sin, positions, cache.k_cache,
                                            cache.v_cache, cache.slot_mapping, lora=lora,
                                            k_scale=cache.k_scale, v_scale=cache.v_scale)
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
