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

import numpy as np
import torch
from torch import Tensor


@dataclass
class LoRAKernelMeta:
    token_lora_slot: Tensor   # int32 [max_tokens]     slot per token, -1 = no LoRA (also padding)
    sorted_token_ids: Tensor  # int32 [max_tokens]     token indices sorted (stable) by slot
    active_slots: Tensor      # int32 [max_loras + 1]  slots present this step, then -1 entries
    slot_token_count: Tensor  # int32 [max_loras + 1]  tokens of each active_slots entry
    slot_token_start: Tensor  # int32 [max_loras + 1]  start of each entry in sorted_token_ids
    flat: Tensor | None = None  # the one buffer all five are views of (one copy per step)
    staging: Tensor | None = None  # pinned host mirror of `flat` (CUDA) for prepare_host

    @classmethod
    def allocate(cls, max_tokens: int, max_loras: int, device) -> "LoRAKernelMeta":
        if max_tokens < 1 or max_loras < 1:
            raise ValueError(f"max_tokens and max_loras must be >= 1, got {max_tokens}, {max_loras}")
        n_tok, n_ent = max_tokens, max_loras + 1
        flat = torch.empty(2 * n_tok + 3 * n_ent, dtype=torch.int32, device=device)
        views = flat.split([n_tok, n_tok, n_ent, n_ent, n_ent])
        meta = cls(*views, flat=flat)
        meta.token_lora_slot.fill_(-1)
        meta.sorted_token_ids.copy_(torch.arange(max_tokens, dtype=torch.int32))
        meta.active_slots.fill_(-1)
        meta.slot_token_count.zero_()
        meta.slot_token_start.zero_()
        pin = flat.is_cuda
        meta.staging = torch.empty(flat.shape, dtype=torch.int32, pin_memory=pin)
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

    def prepare_host(self, token_slots: list[int]) -> None:
        """Same result as prepare(), computed on the host from a Python list and sent to the
        device in one copy: per decode step this replaces ~15 small GPU ops by one transfer.
        Call it only between steps (the staging buffer is reused; the engine syncs on the
        sampled tokens every step)."""
        T, n_tok, L = len(token_slots), self.max_tokens, self.max_loras
        if T > n_tok:
            raise ValueError(f"{T} tokens exceed the metadata capacity {n_tok}")
        host = self.staging.numpy()
        slots = host[:n_tok]
        slots[:T] = token_slots
        slots[T:] = -1
        host[n_tok:2 * n_tok] = np.argsort(slots, kind="stable")
        counts = np.bincount(slots.astype(np.int64) + 1, minlength=L + 1)  # [0] = slot -1
        starts = np.cumsum(counts) - counts
        present = np.nonzero(counts[1:])[0]  # ascending slot ids
        base = 2 * n_tok
        entries = host[base:base + 3 * (L + 1)].reshape(3, L + 1)
        entries[0] = -1
        entries[1:] = 0
        entries[0, :len(present)] = present
        entries[1, :len(present)] = counts[1:][present]
        entries[2, :len(present)] = starts[1:][present]
        self.flat.copy_(self.staging, non_blocking=True)


def _slot_columns_ok(cols: Tensor, token_slots: Tensor, T: int, S: int, L: int, R: int) -> bool:
    # cols: [T, k*S*R] shrunk values with 1 <= k <= L and contiguous rows' columns; token_slots:
    # int32 with a slot for each of the T rows
    return (cols.dim() == 2 and cols.shape[0] == T and cols.shape[1] % (S * R) == 0
            and 1 <= cols.shape[1] // (S * R) <= L and cols.stride(1) == 1
            and token_slots.dtype == torch.int32 and token_slots.numel() >= T)


@dataclass
class LoRADelta:
    """A projection's LoRA delta, left for the kernel that consumes the projection's output.

    On a fused LoRA decode step the base GEMM also computed `shrunk` (x @ A.T for every slice
    and slot, see kernels/lora_delta.py); the consumer adds shrunk . B for each token's slot
    before its own math, so no separate expand runs.
    """
    # [T, k*S*R], k <= L (the step's slot bound: every token's slot is < k), slot-major:
    # column (l*S + s)*R + r = x[t] . A[s, l, r]; rows may be strided
    shrunk: Tensor
    lora_b: Tensor            # [L, N, R] fused output layout, scaling folded in
    token_slots: Tensor       # int32 [>= T] slot per token, -1 = no LoRA (also padding)
    slice_offsets: tuple[int, ...]  # S + 1 column offsets into N

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1

    @property
    def num_slots(self) -> int:
        """k: the slots 0..k-1 whose shrunk values are present (tokens' slots must be < k)."""
        _, _, R = self.lora_b.shape
        return self.shrunk.shape[1] // (self.num_slices * R)

    def validate(self, T: int, N: int, num_slices: int, device) -> None:
        L, Nb, R = self.lora_b.shape
        S = self.num_slices
        ok = (Nb == N and S == num_slices and self.slice_offsets[0] == 0
              and self.slice_offsets[-1] == N and self.lora_b.is_contiguous()
              and _slot_columns_ok(self.shrunk, self.token_slots, T, S, L, R)
              and self.shrunk.device == self.lora_b.device == self.token_slots.device == device)
        if not ok:
            raise ValueError(
                f"LoRA delta does not fit its consumer: want T={T}, N={N}, {num_slices} slices on "
                f"{device}; got shrunk {tuple(self.shrunk.shape)}, lora_b {tuple(self.lora_b.shape)}, "
                f"slice_offsets {self.slice_offsets}, {self.token_slots.numel()} {self.token_slots.dtype} "
                f"slots")

    def apply_reference(self, y: Tensor) -> Tensor:
        """y [T, N] -> new y + delta (torch reference: fp32 math, one rounding)."""
        from batchrun.kernels.reference import ref_lora_delta
        return ref_lora_delta(y, self.shrunk, self.lora_b, self.slice_offsets, self.token_slots)


@dataclass(frozen=True)
class LoRAShrink:
    """The shrink of the projection after a norm, for the norm kernel to compute beside its
    output (kernels/rms_norm_shrink.py): on a fused LoRA decode step whose gate_up runs as the
    fused GEMM + SiLU kernel, which can stream only W, the norm that produces x also writes
    `out[t, (slot*S + s)*R + r] = rnd(x[t] . A[s, slot, r])` for each row's own slot (the
    columns a LoRADelta's consumer reads; other slots' columns are left unwritten)."""
    lora_a: Tensor       # [S, L, R, K] (a LoRALinear's strided view of its slot-major A rows)
    token_slots: Tensor  # int32 [>= T] slot per row, -1 = no LoRA (also padding), else < k
    out: Tensor          # [T, k*S*R] in x's dtype, k = the step's slot bound

    @property
    def num_slots(self) -> int:
        """k: the slots whose columns `out` has room for."""
        S, _, R, _ = self.lora_a.shape
        return self.out.shape[1] // (S * R)

    def validate(self, T: int, K: int, dtype, device) -> None:
        S, L, R, Ka = self.lora_a.shape
        ok = (Ka == K and self.lora_a.stride(3) == 1 and self.out.dtype == dtype
              and self.lora_a.dtype == dtype
              and _slot_columns_ok(self.out, self.token_slots, T, S, L, R)
              and self.lora_a.device == self.out.device == self.token_slots.device == device)
        if not ok:
            raise ValueError(
                f"LoRA shrink does not fit its norm: want T={T}, K={K}, {dtype} on {device}; got "
                f"lora_a {tuple(self.lora_a.shape)} {self.lora_a.dtype}, out "
                f"{tuple(self.out.shape)} {self.out.dtype}, {self.token_slots.numel()} "
                f"{self.token_slots.dtype} slots")
