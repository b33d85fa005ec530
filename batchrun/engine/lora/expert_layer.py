"""The LoRA slots of one tensor of a mixture-of-experts block (lora/experts.py says what PEFT
saves and how it is read): A [slots, E, R, in], B [slots, E, out, R], scaling folded into B;
the router's E is 1. layers/moe.py applies them; the LoRA manager writes them."""
from __future__ import annotations

import torch
from torch import Tensor


class ExpertLoRA:
    """The slots of one expert-block tensor's LoRA: A [slots, E, R, in], B [slots, E, out, R]
    (zero beyond an adapter's rank and in slots whose adapter does not target it). Allocated
    once, written in place."""
    bias_full = None  # what the manager's other hooks have (no LoRA bias here)
    num_slices = 1

    def __init__(self, experts: int, in_features: int, out_features: int, max_loras: int,
                 max_rank: int, device, dtype: torch.dtype):
        self.lora_a = torch.zeros(max_loras, experts, max_rank, in_features, device=device, dtype=dtype)
        self.lora_b = torch.zeros(max_loras, experts, out_features, max_rank, device=device, dtype=dtype)
        self.slice_offsets = (0, out_features)

    def set_slot(self, slot: int, slices: dict[int, tuple[Tensor, Tensor]]) -> None:
        self.clear_slot(slot)
        a, b = slices[0]  # [E, r, in], [E, out, r]
        r = a.shape[1]
        assert a.shape[0] == b.shape[0] == self.lora_a.shape[1] and a.shape[2] == self.lora_a.shape[3] \
            and b.shape[1:] == (self.lora_b.shape[2], r), "bad expert LoRA shape"
        self.lora_a[slot, :, :r].copy_(a)
        self.lora_b[slot, :, :, :r].copy_(b)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def swap_slots(self, i: int, j: int) -> None:
        for t in (self.lora_a, self.lora_b):
            t_i = t[i].clone()
            t[i].copy_(t[j])
            t[j].copy_(t_i)
