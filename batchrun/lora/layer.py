"""The LoRA hook attached to a fused Linear (`Linear.lora`).

`apply(x, y)` adds the step's adapter deltas into y in place. When the step has no LoRA tokens
(`manager.has_lora` is False) it returns before launching anything, so a no-LoRA step, and a
CUDA graph captured for one, holds exactly the base model's kernels.
"""
from __future__ import annotations

import torch
from torch import Tensor

from batchrun.lora import punica


class LoRALinear:
    def __init__(self, manager, in_features: int, output_sizes: list[int], max_loras: int,
                 max_rank: int, device, dtype: torch.dtype):
        self.manager = manager  # owns has_lora, the shared fp32 scratch buffer and the metadata
        self.output_sizes = list(output_sizes)
        S = len(output_sizes)
        offs = [0]
        for n in output_sizes:
            offs.append(offs[-1] + n)
        self.slice_offsets = tuple(offs)
        # Stacked per-slot weights, allocated once and written in place when a slot is loaded
        # (captured graphs hold their pointers). Zero beyond an adapter's rank and for slices or
        # layers it does not target, so those contribute nothing.
        self.lora_a = torch.zeros(S, max_loras, max_rank, in_features, device=device, dtype=dtype)
        self.lora_b = torch.zeros(max_loras, offs[-1], max_rank, device=device, dtype=dtype)

    @property
    def num_slices(self) -> int:
        return len(self.output_sizes)

    def set_slot(self, slot: int, slices: dict[int, tuple[Tensor, Tensor]]) -> None:
        """Write one adapter into `slot`: slices maps slice index -> (A [r, in], B [out_s, r])."""
        self.lora_a[:, slot].zero_()
        self.lora_b[slot].zero_()
        for s, (a, b) in slices.items():
            r = a.shape[0]
            lo, hi = self.slice_offsets[s], self.slice_offsets[s + 1]
            assert a.shape[1] == self.lora_a.shape[3] and b.shape == (hi - lo, r), "bad LoRA shape"
            self.lora_a[s, slot, :r].copy_(a)
            self.lora_b[slot, lo:hi, :r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[:, slot].zero_()
        self.lora_b[slot].zero_()

    def apply(self, x: Tensor, y: Tensor) -> None:
        # x: [T, in], y: [T, out] (base output, updated in place)
        m = self.manager
        if not m.has_lora:
            return
        # m.shrink_buffer: flat fp32 scratch shared by all layers; add_lora views its split-K
        # partials [splits, S, T, R] out of it.
        punica.add_lora(x, y, self.lora_a, self.lora_b, m.shrink_buffer, self.slice_offsets,
                        m.meta)
