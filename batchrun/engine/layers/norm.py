"""RMSNorm, computed in fp32 and cast back like HF's LlamaRMSNorm (offset 0) or GemmaRMSNorm
(offset 1: scale 1 + weight in fp32, cast after it), optionally fused with the residual add
before it (vLLM pattern): `norm(x, residual) -> (normed, x + residual)`.

On CUDA it runs one Triton kernel (the residual is updated in place); on CPU the torch
reference (kernels/reference.py: HF's ops, in its order). A pending LoRA delta of the
projection before the norm (LoRADelta) is added to x inside the same kernel.

On x of shape [T, Hh, D] with a weight of D it is a per-head norm (Gemma 3's q_norm / k_norm):
each head normed over D, x read through its strides (a head view of the fused qkv output is
not copied); that form takes no residual, delta or shrink.
"""
from __future__ import annotations

import torch
from torch import nn

from batchrun.kernels.lora_meta import LoRADelta, LoRAShrink
from batchrun.kernels.reference import ref_fused_add_rms_norm, ref_lora_shrink_rows, ref_rms_norm
from batchrun.engine.layers.backend import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0):
        # offset: 0.0 for Llama-style checkpoints (scale = weight), 1.0 for Gemma's (scale =
        # 1 + weight, and the cast to the model dtype after the scale)
        super().__init__()
        self.eps = eps
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                lora: LoRADelta | None = None, shrink: LoRAShrink | None = None):
        # x: [T, H] -> normed [T, H]; with residual [T, H]: (normed, x + residual).
        # lora: the pending LoRA delta of the projection that produced x (x + delta is normed).
        # shrink: the next projection's LoRA shrink of the normed rows, written to shrink.out.
        # x: [T, Hh, D] -> each head normed over D, [T, Hh, D] (no residual, lora or shrink).
        if x.dim() == 3 and (residual is not None or lora is not None or shrink is not None):
            raise ValueError("a per-head norm ([T, heads, head_dim]) takes no residual, LoRA "
                             "delta or shrink")
        if use_triton(x):
            from batchrun.kernels.fused_add_rms_norm import fused_add_rms_norm, rms_norm
            if residual is None:
                return rms_norm(x, self.weight, self.eps, lora=lora, shrink=shrink,
                                offset=self.offset)
            return fused_add_rms_norm(x, residual, self.weight, self.eps, lora=lora,
                                      shrink=shrink, offset=self.offset)
        if lora is not None:
            x = lora.apply_reference(x)
        if residual is None:
            out = ref_rms_norm(x, self.weight, self.eps, self.offset)
        else:
            out = ref_fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset)
        if shrink is not None:
            normed = out if residual is None else out[0]
            shrink.out.copy_(ref_lora_shrink_rows(normed, shrink.lora_a, shrink.token_slots,
                                                  shrink.num_slots))
        return out

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                 lora: LoRADelta | None = None, shrink: LoRAShrink | None = None):
        """The residual stream's add + norm: (norm(residual + x), residual + x); the first
        layer's (residual None, no delta before it) starts the stream at x."""
        if residual is None:
            assert lora is None, "a pending LoRA delta before the first layer"
            return self(x, shrink=shrink), x
        return self(x, residual, lora=lora, shrink=shrink)
