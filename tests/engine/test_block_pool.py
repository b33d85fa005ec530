"""Prefix-cache bookkeeping without a model: hash chain, reference counts, LRU eviction order,
adapter isolation, admission accounting and preemption (block_pool.py, block_manager.py)."""
from batchrun.engine.config import SamplingParams
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.block_pool import ROOT_HASH, BlockPool, block_hash
from batchrun.engine.sequence import Sequence

BS = 4


def seq(tokens, adapter=None, index=0):
    return Sequence(index, index, list(tokens), SamplingParams(), adapter, None)


def filled(bm: BlockManager, s: Sequence) -> Sequence:
    """Admit s and register what its prefill computes (what the scheduler does in one step)."""
    assert bm.admit(s)
    bm.cache_blocks(s, s.num_tokens)
    s.num_computed = s.num_tokens
    return s


def test_hash_chain_covers_parent_tokens_and_adapter():
    a = block_hash(ROOT_HASH, None, [1, 2, 3, 4])
    assert a == block_hash(ROOT_HASH, None, [1, 2, 3, 4])
    assert a != block_hash(ROOT_HASH, None, [1, 2, 3, 5])
    assert a != block_hash(ROOT_HASH, "lora", [1, 2, 3, 4])
    assert block_hash(ROOT_HASH, "a", [1]) != block_hash(ROOT_HASH, "b", [1])
    # the same tokens after a different first block hash differently
    b1 = block_hash(a, None, [9, 9, 9, 9])
    b2 = block_hash(block_hash(ROOT_HASH, None, [7, 7, 7, 7]), None, [9, 9, 9, 9])
    assert b1 != b2


def test_shared_prefix_is_reused_and_last_token_recomputed():
    bm = BlockManager(32, BS, enable_caching=True)
    a = filled(bm, seq(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    b = seq(list(range(8)) + [50, 51, 52])
    assert bm.admit(b)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert b.num_computed == 8
    # a prompt that is all cached full blocks still computes its last token: 7 of 8 tokens
    # are cached at most, i.e. one full block (4), and its second block is its own
    c = seq(range(8))
    assert bm.admit(c)
    assert c.num_computed == 4 and c.block_ids[0] == a.block_ids[0]
    assert c.block_ids[1] != a.block_ids[1]
    assert bm.pool.ref_count[a.block_ids[0]] == 3 and bm.pool.ref_count[a.block_ids[1]] == 2


def test_caching_off_shares_nothing():
    bm = BlockManager(32, BS, enable_caching=False)
    a = filled(bm, seq(range(12)))
    b = seq(range(12))
    assert bm.admit(b)
    assert b.num_computed == 0 and not set(a.block_ids) & set(b.block_ids)


def test_adapter_isolation():
    bm = BlockManager(32, BS, enable_caching=True)
    base = filled(bm, seq(range(12)))
    lora = seq(range(12), adapter="a")
    assert bm.admit(lora)
    assert lora.num_computed == 0 and not set(base.block_ids) & set(lora.block_ids)
    bm.cache_blocks(lora, 12)
    other = seq(range(12), adapter="b")
    assert bm.admit(other) and other.num_computed == 0
    same = seq(range(12), adapter="a")
    assert bm.admit(same) and same.num_computed == 8 and same.block_ids[:2] == lora.block_ids[:2]


def test_shared_block_freed_by_its_last_user_only():
    bm = BlockManager(8, BS, enable_caching=True)  # 7 usable
    a = filled(bm, seq(range(9)))  # 3 blocks
    b = seq(list(range(8)) + [99])
    assert bm.admit(b)  # 2 shared + 1 own
    assert bm.num_free == 7 - 4
    bm.release(a)
    assert bm.num_free == 7 - 3  # a's own last block only: the shared two are still b's
    assert all(bm.pool.ref_count[x] == 1 for x in b.block_ids)
    bm.release(b)
    assert bm.num_free == 7 and all(r == 0 for r in bm.pool.ref_count)
    # freed but cached: a new row with the prefix still finds them
    c = seq(list(range(8)) + [5, 5])
    assert bm.admit(c) and c.num_computed == 8


def test_lru_eviction_order():
    pool = BlockPool(6, first_usable=1)  # blocks 1..5
    x = pool.allocate(2)
    y = pool.allocate(2)
    pool.register(x[0], b"x0"); pool.register(x[1], b"x1")
    pool.register(y[0], b"y0")  # y[1] never full: no hash
    pool.free_blocks(x)  # x's tail first: queue = [5(fresh), x1, x0]
    pool.free_blocks(y)  # y[1] (no hash) to the front, y0 to the back
    assert list(pool.free) == [y[1], 5, x[1], x[0], y[0]]
    got = pool.allocate(3)  # the unhashed ones first, then the least recently freed cached one
    assert got == [y[1], 5, x[1]]
    assert pool.lookup(b"x1") is None and pool.lookup(b"x0") == x[0]  # evicted / still cached
    pool.touch([x[0]])  # a hit takes it out of the free queue: not evictable while held
    assert x[0] not in pool.free and pool.ref_count[x[0]] == 1
    assert pool.allocate(1) == [y[0]] and pool.lookup(b"y0") is None


def test_admission_counts_idle_hit_blocks_once():
    bm = BlockManager(6, BS, enable_caching=True)  # 5 usable
    a = filled(bm, seq(range(12)))  # 3 blocks
    bm.release(a)  # all 5 free, 3 of them cached
    # 4 blocks needed: 2 hits (idle, in the free queue) + 2 fresh = 4 of the 5 free blocks
    b = seq(list(range(8)) + [7, 7, 7, 7, 7, 7])
    assert bm.admit(b) and b.num_computed == 8 and bm.num_free == 1
    bm.release(b)
    # 6 blocks wanted, 5 free: refused, and nothing was taken
    c = seq(list(range(8)) + [3] * 16)
    assert not bm.admit(c)
    assert c.block_ids == [] and c.num_computed == 0 and bm.num_free == 5
    assert all(r == 0 for r in bm.pool.ref_count)


def test_preempted_row_hits_its_own_blocks_on_readmission():
    bm = BlockManager(16, BS, enable_caching=True)
    s = filled(bm, seq(range(6)))
    for t in (60, 61, 62, 63, 64):  # decode: each step registers the blocks it fills
        s.token_ids.append(t)
        bm.allocate(s, s.num_tokens)
        bm.cache_blocks(s, s.num_tokens)
    assert s.num_cached_blocks == 2  # 11 tokens: two full blocks
    before = list(s.block_ids)
    bm.release(s)
    s.reset_for_recompute()
    assert s.num_cached_blocks == 0 and len(s.block_hashes) == 2
    assert bm.admit(s)
    assert s.block_ids[:2] == before[:2] and s.num_computed == 8  # prompt + outputs so far
    assert bm.pool.ref_count[before[0]] == 1


def test_reset_cache_forgets_every_hash():
    bm = BlockManager(16, BS, enable_caching=True)
    a = filled(bm, seq(range(12)))
    bm.release(a)
    bm.reset_cache()
    b = seq(range(12))
    assert bm.admit(b) and b.num_computed == 0


def test_is_ready_means_allocate_and_cache_blocks_would_do_nothing():
    for caching in (False, True):
        bm = BlockManager(num_blocks=16, block_size=BS, enable_caching=caching)
        s = seq(list(range(2 * BS - 1)))
        assert bm.admit(s)                           # 2 blocks for 2*BS - 1 tokens
        assert bm.is_ready(s, 2 * BS - 1) == (not caching)   # its first block full, not registered
        bm.cache_blocks(s, 2 * BS - 1)
        assert bm.is_ready(s, 2 * BS - 1)            # fits, its one full block registered
        assert not bm.is_ready(s, 2 * BS + 1)        # needs a third block
        s.token_ids.append(7)
        assert bm.is_ready(s, 2 * BS) == (not caching)   # the second block is now full
        bm.allocate(s, 2 * BS); bm.cache_blocks(s, 2 * BS)
        assert bm.is_ready(s, 2 * BS)
