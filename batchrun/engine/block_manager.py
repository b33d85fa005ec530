"""Paged KV cache bookkeeping: fixed-size blocks handed to sequences and taken back.

Block 0 is reserved as a scratch block: padded rows of a captured decode step write there, so it
is never given to a sequence.
"""
from __future__ import annotations

from collections import deque

from batchrun.engine.sequence import Sequence

SCRATCH_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        assert num_blocks >= 2, "need at least one usable block besides the scratch block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so that its first num_tokens tokens have cache slots."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_ids))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.blocks_needed(seq, num_tokens)
        assert n <= self.num_free, "allocate() without can_allocate()"
        seq.block_ids.extend(self.free.popleft() for _ in range(n))

    def release(self, seq: Sequence) -> None:
        self.free.extend(seq.block_ids)
        seq.block_ids = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of the token at `position` of seq."""
        return seq.block_ids[position // self.block_size] * self.block_size + position % self.block_size
