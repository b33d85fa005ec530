"""The KV block pool: reference counts, an LRU free queue and the prefix-cache hash map.

A block is either in use (ref_count > 0: held by one or more sequences) or free (in the free
queue). With prefix caching a full block whose K/V are computed is registered under its hash
(`block_hash`); when it is freed it keeps that hash and its K/V, so a later sequence with the
same prefix can take it back (`touch`) until the pool hands it out as a fresh block, which
evicts it from the map. The free queue is LRU: `allocate` pops the front, freed blocks with a
hash go to the back, freed blocks without one to the front (nothing is lost by reusing them).

Hashes are sha256 digests (collisions are not a practical concern, unlike 64-bit hash()), chained
over the parent block's hash so that equal token blocks after different prefixes differ, and
keyed by the adapter: a LoRA row's K/V differ from the base model's for the same tokens.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

ROOT_HASH = bytes(32)  # the "parent" of a sequence's first block
# ... of a sequence rotated with LongRoPE's long table: its K/V differ from the same tokens'
# under the short table, so the two never share cached blocks
LONG_ROPE_ROOT_HASH = b"\x01" * 32


def block_hash(parent: bytes, adapter: str | None, tokens) -> bytes:
    """Hash of one full block: its tokens, everything before it (parent) and the adapter."""
    h = hashlib.sha256(parent)
    if adapter is None:
        h.update(b"\x00")
    else:  # length-prefixed, so the adapter name and the token bytes cannot run into each other
        name = adapter.encode()
        h.update(b"\x01" + len(name).to_bytes(4, "little") + name)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, first_usable: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding that K/V
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(first_usable, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks from the front of the free queue (cached ones lose their hash)."""
        assert n <= len(self.free), "BlockPool.allocate() beyond the free blocks"
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of[b]
            if h is not None:  # evict: its K/V are about to be overwritten
                del self.cached[h]
                self.hash_of[b] = None
            self.ref_count[b] = 1
            out.append(b)
        return out

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h)

    def touch(self, blocks: list[int]) -> None:
        """Take cached blocks for one more sequence (out of the free queue if no one held them)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1

    def register(self, block: int, h: bytes) -> None:
        """block now holds computed K/V for hash h. If another block already holds h, this one
        stays unregistered (a duplicate: its sequence computed the same tokens itself)."""
        if self.hash_of[block] is None and h not in self.cached:
            self.cached[h] = block
            self.hash_of[block] = h

    def free_blocks(self, blocks: list[int]) -> None:
        """One sequence lets go of blocks (in its order). Its last blocks are queued first, so
        under pressure a prefix outlives the tails that hang off it."""
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            assert self.ref_count[b] >= 0, f"block {b} freed more often than taken"
            if self.ref_count[b] == 0:
                self.free[b] = None
                if self.hash_of[b] is None:
                    self.free.move_to_end(b, last=False)

    def reset_cache(self) -> None:
        """Forget every hash (the K/V of some registered block may not have been written)."""
        for h, b in self.cached.items():
            self.hash_of[b] = None
        self.cached.clear()
