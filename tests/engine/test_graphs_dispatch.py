"""The CUDA-graph dispatcher (engine/cudagraph_dispatcher.py): capture sizes and the pure
dispatch function, on CPU."""
import random

import pytest
import torch

from batchrun.engine.cudagraph_dispatcher import (CaptureSizes, CudaGraphs, GraphKey, Mode,
                                                  capture_sets, capture_sizes, dispatch,
                                                  token_buckets)
from batchrun.engine.layers.step import LoRAStep


def test_default_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    assert capture_sizes(8, [8, 3, 100]) == [3, 8]
    with pytest.raises(ValueError):
        capture_sizes(4, [16])


def test_token_buckets():
    assert token_buckets(512) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(20) == [16, 20]
    assert token_buckets(8) == [8]
    assert token_buckets(0) == []


@pytest.mark.parametrize("max_num_seqs", [1, 7, 8, 20, 64, 256])
def test_decode_steps_replay_the_smallest_full_graph_that_holds_them(max_num_seqs):
    sizes = CaptureSizes(tuple(capture_sizes(max_num_seqs)), tuple(token_buckets(512)))
    rng = random.Random(max_num_seqs)
    for _ in range(500):
        b = rng.randint(1, max_num_seqs + 40)
        slots = rng.choice([0, 0, 1, 2, 4, 8])  # slot bound, 0 = no adapter row
        mode, key = dispatch(b, True, slots, sizes)
        if b > max_num_seqs:
            assert (mode, key) == (Mode.EAGER, None)  # never piecewise: decode rows stay full
            continue
        assert mode is Mode.FULL and key.decode_only
        assert key.lora_slots == slots  # the set of the step's slot bound, never the no-LoRA set
        assert key.has_lora == (slots > 0)
        assert key.tokens in sizes.decode and key.tokens >= b
        assert not any(b <= s < key.tokens for s in sizes.decode)  # minimal padding


def test_prefill_steps_replay_pieces_when_capturable():
    sizes = CaptureSizes((1, 2, 4), (16, 32, 64, 100))
    assert dispatch(1, False, 0, sizes) == (Mode.PIECEWISE, GraphKey(16, False, 0))
    assert dispatch(33, False, 2, sizes) == (Mode.PIECEWISE, GraphKey(64, False, 2))
    assert dispatch(100, False, 1, sizes) == (Mode.PIECEWISE, GraphKey(100, False, 1))
    assert dispatch(101, False, 0, sizes) == (Mode.EAGER, None)  # larger than any capture
    # decode rows or device-side tokens (mixed / async steps): the static inputs lack them
    assert dispatch(8, False, 0, sizes, piecewise=False) == (Mode.EAGER, None)
    # LoRA pieces are captured fused: a step whose LoRA part is not fused runs eagerly, a
    # step without adapter tokens does not care
    assert dispatch(8, False, 1, sizes, fused=False) == (Mode.EAGER, None)
    assert dispatch(8, False, 0, sizes, fused=False) == (Mode.PIECEWISE, GraphKey(16, False, 0))
    # nothing captured (CPU, enforce_eager, before capture): every step eager
    for decode_only in (True, False):
        assert dispatch(3, decode_only, 0, CaptureSizes()) == (Mode.EAGER, None)


def test_dispatch_rejects_bad_steps():
    with pytest.raises(ValueError):
        dispatch(0, True, 0, CaptureSizes((1, 2)))
    with pytest.raises(ValueError):
        dispatch(1, False, -1, CaptureSizes((1, 2)))
    with pytest.raises(AssertionError, match="LoRA row"):
        CudaGraphs(with_lora=False).dispatch(1, True, 1)


def test_capture_sets_are_checked_once_for_both_kinds():
    meta = torch.zeros(1)
    step = lambda k: LoRAStep(meta, meta, fuse=True, num_slots=k)  # noqa: E731
    assert capture_sets(False, None) == [(0, None)]
    one, four = step(1), step(4)
    assert capture_sets(True, {1: one, 4: four}) == [(0, None), (4, four), (1, one)]
    with pytest.raises(ValueError, match="needs LoRA steps"):
        capture_sets(True, None)
    with pytest.raises(ValueError, match="needs no LoRA step"):
        capture_sets(False, {1: one})
    with pytest.raises(ValueError, match="keyed by their slot bound"):
        capture_sets(True, {2: one})
