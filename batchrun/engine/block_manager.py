"""Paged KV cache bookkeeping: fixed-size blocks handed to sequences and taken back, and (with
prefix caching) blocks shared by sequences whose prompts start with the same tokens.

Block 0 is reserved as a scratch block: padded rows of a captured decode step write there, so it
is never given to a sequence.

Prefix caching (`enable_caching`): a sequence's full blocks are hashed in a chain
(block_pool.block_hash: tokens, parent hash, adapter). On admission (`admit`) a sequence takes
the longest run of its leading blocks found in the pool (reference counted, so a block shared by
running rows is freed only by its last user) and starts its prefill after them. At most
(num_tokens - 1) // block_size blocks are taken: the last prompt token is always computed again,
because its logits are needed to sample. Blocks are registered (`cache_blocks`) when they are
scheduled to be filled, i.e. while the step that computes their K/V is being planned; a
sequence admitted later in the same step may already take them. That is safe because every
attention layer writes the whole step's K/V into the cache before any row attends
(layers/attention.py), so a row reads the shared block after its owner wrote it. If a step
fails, `reset_cache` forgets every hash (the scheduler's abort does it).
"""
from __future__ import annotations

from batchrun.engine.block_pool import LONG_ROPE_ROOT_HASH, ROOT_HASH, BlockPool, block_hash
from batchrun.engine.sequence import Sequence

SCRATCH_BLOCK = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        assert num_blocks >= 2, "need at least one usable block besides the scratch block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, first_usable=SCRATCH_BLOCK + 1)

    @property
    def num_free(self) -> int:
        """Blocks a sequence can be given now (free ones, cached or not)."""
        return self.pool.num_free

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks seq needs so that its first num_tokens tokens have cache slots."""
        want = -(-num_tokens // self.block_size)
        return max(0, want - len(seq.block_ids))

    def is_ready(self, seq: Sequence, num_tokens: int) -> bool:
        """seq already has slots for its first num_tokens tokens and no full block among them
        left to register: allocate and cache_blocks would do nothing (one cheap check, for the
        scheduler's hot decode loop)."""
        bs = self.block_size
        return (len(seq.block_ids) * bs >= num_tokens
                and (not self.enable_caching or num_tokens // bs <= seq.num_cached_blocks))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        n = self.blocks_needed(seq, num_tokens)
        assert n <= self.num_free, "allocate() without can_allocate()"
        seq.block_ids.extend(self.pool.allocate(n))

    # ---- prefix caching ---------------------------------------------------------------------
    def admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence (no blocks yet) blocks for its whole prompt: cached prefix
        blocks first, fresh ones for the rest; sets seq.num_computed past the cached prefix.
        False (and nothing changed) when the free blocks do not suffice."""
        assert not seq.block_ids and seq.num_computed == 0, "admit() of a sequence holding blocks"
        hits = self._cached_prefix(seq)
        # hit blocks nobody holds sit in the free queue: taking them leaves fewer for the rest
        idle_hits = sum(self.pool.ref_count[b] == 0 for b in hits)
        fresh = -(-seq.num_tokens // self.block_size) - len(hits)
        if fresh + idle_hits > self.num_free:
            return False
        self.pool.touch(hits)
        seq.block_ids = hits + self.pool.allocate(fresh)
        seq.num_computed = len(hits) * self.block_size
        seq.num_cached_blocks = len(hits)
        return True

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        if not self.enable_caching:
            return []
        limit = (seq.num_tokens - 1) // self.block_size  # the last token is always computed
        hashes = self._hashes(seq, limit)
        hits = []
        for h in hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register seq's full blocks among its first num_tokens tokens: the step being planned
        computes their K/V (see the module doc)."""
        # only blocks whose tokens are all known: a token still on its way from the device
        # (async steps, engine.py) is hashed by the step that plans after it is read back
        full = min(num_tokens, len(seq.token_ids)) // self.block_size
        if not self.enable_caching or full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            self.pool.register(seq.block_ids[i], hashes[i])
        seq.num_cached_blocks = full

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """seq's first n block hashes, extending the ones it keeps (its tokens only grow, and a
        preempted sequence keeps them for its re-admission)."""
        hs, bs = seq.block_hashes, self.block_size
        if n * bs > len(seq.token_ids):
            raise AssertionError(f"hash of {n} blocks of a sequence with {len(seq.token_ids)} known tokens")
        root = LONG_ROPE_ROOT_HASH if seq.long_rope else ROOT_HASH
        while len(hs) < n:
            i = len(hs)
            hs.append(block_hash(hs[-1] if hs else root, seq.adapter, seq.token_ids[i * bs:(i + 1) * bs]))
        return hs

    def reset_cache(self) -> None:
        self.pool.reset_cache()

    # ---------------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        self.pool.free_blocks(seq.block_ids)
        seq.block_ids = []
        seq.num_cached_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of the token at `position` of seq."""
        return seq.block_ids[position // self.block_size] * self.block_size + position % self.block_size
