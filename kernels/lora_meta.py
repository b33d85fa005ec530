"""Per-step LoRA metadata shared by the shrink and expand kernels (Punica SGMV layout).

The buffers are allocated once at their maximum size and rewritten in place by `prepare`, so a
CUDA graph that captured a kernel reading them replays correctly for any later batch. Tokens are
grouped by slot: `sorted_token_ids` lists token indices slot by slot, and each entry e of
`active_slots` describes one group (slot, count, start). Kernels launch one program column per
entry (grid axis 2 = max_loras + 1) and return at once for entries that are -1.

Layout written by `prepare`: the slots present this step come first, in ascending order, then
-1 entries (count 0). The slot -1 group (no LoRA, and padding) never gets an entry, so kernels
never touch those tokens. `prepare` is sync-free (sort + scatter_add, no unique/bincount, whose
output sizes depend on data).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LoRAKernelMeta:
    token_lora_slot: Tensor   # int32 [max_tokens]     slot per token, -1 = no LoRA (also padding)
    sorted_token_ids: Tensor  # int32 [max_tokens]     token indices sorted (stable) by slot
    active_slots: Tensor      # int32 [max_loras + 1]  slots present this step, then -1 entries
    slot_token_count: Tensor  # int32 [max_loras + 1]  tokens of each active_slots entry
    slot_token_start: Tensor  # int32 [max_loras + 1]  start of each entry in sorted_token_ids

    @classmethod
    def allocate(cls, max_tokens: int, max_loras: int, device) -> "LoRAKernelMeta":
        if max_tokens < 1 or max_loras < 1:
            raise ValueError(f"max_tokens and max_loras must be >= 1, got {max_tokens}, {max_loras}")
        i32 = dict(dtype=torch.int32, device=device)
        meta = cls(
            token_lora_slot=torch.full((max_tokens,), -1, **i32),
            sorted_token_ids=torch.arange(max_tokens, **i32),
            active_slots=torch.full((max_loras + 1,), -1, **i32),
            slot_token_count=torch.zeros(max_loras + 1, **i32),
            slot_token_start=torch.zeros(max_loras + 1, **i32),
        )
        return meta

    @property
    def max_tokens(self) -> int:
        return self.token_lora_slot.shape[0]

    @property
    def max_loras(self) -> int:
        return self.active_slots.shape[0] - 1

    def prepare(self, token_slots: Tensor) -> None:
        # token_slots: int [T], T <= max_tokens, values in [-1, max_loras), any device.
        # Values are not range-checked here (that would need a host sync); the slot manager
        # hands out slot ids, so a bad id is an internal bug.
        assert token_slots.dim() == 1, "token_slots must be 1-D"
        T = token_slots.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"{T} tokens exceed the metadata capacity {self.max_tokens}")
        L = self.max_loras
        dev = self.token_lora_slot.device

        self.token_lora_slot[:T].copy_(token_slots, non_blocking=True)
        self.token_lora_slot[T:].fill_(-1)
        # Stable sort of the whole buffer: padding tokens (slot -1) sort first with the no-LoRA
        # tokens, and every entry of sorted_token_ids stays a valid token index.
        order = torch.sort(self.token_lora_slot, stable=True).indices
        self.sorted_token_ids.copy_(order)

        # counts[0] = tokens of slot -1, counts[1 + s] = tokens of slot s (fixed size: no sync).
        counts = torch.zeros(L + 1, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, self.token_lora_slot.long() + 1,
                            torch.ones(self.max_tokens, dtype=torch.int64, device=dev))
        starts = torch.cumsum(counts, 0) - counts

        # Move present slots to the front, keeping ascending slot order (stable sort on "absent").
        present = counts[1:] > 0                                    # [L]
        entry_slot = torch.sort((~present).to(torch.int8), stable=True).indices  # [L]
        keep = present[entry_slot]
        self.active_slots[:L].copy_(torch.where(keep, entry_slot, -1))
        self.slot_token_count[:L].copy_(torch.where(keep, counts[1:][entry_slot], 0))
        self.slot_token_start[:L].copy_(torch.where(keep, starts[1:][entry_slot], 0))
        # The spare entry exists so the layout matches "max_loras + 1" groups incl. slot -1;
        # slot -1 never gets an entry, so it is always unused.
        self.active_slots[L] = -1
        self.slot_token_count[L] = 0
        self.slot_token_start[L] = 0
