"""Dispatcher and capture-size table (pure functions, CPU)."""
import random

import pytest

from batchrun.engine.graphs import GraphKey, capture_sizes, dispatch, padded_size_table


def test_default_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    assert capture_sizes(8, [8, 3, 100]) == [3, 8]
    with pytest.raises(ValueError):
        capture_sizes(4, [16])


def test_table_is_minimal_padding():
    sizes = capture_sizes(256)
    table = padded_size_table(sizes)
    assert len(table) == 257
    for b in range(1, 257):
        assert table[b] >= b and table[b] in sizes
        assert not any(b <= s < table[b] for s in sizes)  # no smaller captured size fits


@pytest.mark.parametrize("max_num_seqs", [1, 7, 8, 20, 64, 256])
def test_dispatch_properties(max_num_seqs):
    table = padded_size_table(capture_sizes(max_num_seqs))
    rng = random.Random(max_num_seqs)
    for _ in range(500):
        b = rng.randint(1, max_num_seqs + 40)
        slots = rng.choice([0, 0, 1, 2, 4, 8])  # slot bound, 0 = no adapter row
        key = dispatch(b, slots, table)
        if b > max(table):
            assert key is None  # eager above the largest captured size
            continue
        assert isinstance(key, GraphKey)
        assert key.lora_slots == slots  # the set of the step's slot bound, never the no-LoRA set
        assert key.has_lora == (slots > 0)  # for a step with an adapter row
        assert key.padded_batch_size >= b


def test_dispatch_rejects_empty_batch():
    with pytest.raises(ValueError):
        dispatch(0, 0, padded_size_table([1, 2]))
    with pytest.raises(ValueError):
        dispatch(1, -1, padded_size_table([1, 2]))
