import itertools

import pytest
import torch

from batchrun.kernels.lora_expand import lora_expand
from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.reference import ref_lora_expand
from kernel_testutils import CPU_DTYPES, DEVICE, mixed_slots, randn, rounding_tol

NUM_SLOTS = 4


def offsets(sizes):
    return (0, *itertools.accumulate(sizes))


def run_and_check(T, sizes, R, dtype, slots, gen, T_max=None, splits=1):
    S = len(sizes)
    offs = offsets(sizes)
    N = offs[-1]
    T_max = T_max or T + 3
    buf = randn(splits, S, T_max, R, dtype=torch.float32, gen=gen)  # split-K partials
    lora_b = randn(NUM_SLOTS, N, R, dtype=dtype, gen=gen, scale=R ** -0.5)
    y = randn(T, N, dtype=dtype, gen=gen)  # the base output: slot -1 rows must keep it exactly
    y0 = y.clone()
    meta = LoRAKernelMeta.allocate(max_tokens=T_max, max_loras=NUM_SLOTS, device=DEVICE)
    meta.prepare(slots.to(DEVICE))

    lora_expand(buf, lora_b, y, offs, meta)

    ref = ref_lora_expand(y0, buf.sum(0), lora_b, offs, slots)
    ref_abs = ref_lora_expand(y0.abs(), buf.abs().sum(0), lora_b.abs(), offs, slots).float()
    has = (slots >= 0).to(DEVICE)
    err = (y.float() - ref.float()).abs()
    # The split sum, R products and the y term; 16-bit weights see buf split in hi+lo halves
    # (~2^-16 rel).
    tol = rounding_tol(ref_abs, dtype, splits + R + 1) + 2.0 ** -15 * ref_abs
    assert (err <= tol)[has].all(), err[has].max()
    assert torch.equal(y[~has], y0[~has])


RANKS = [1, 8, 16, 64]
SPLITS = [1, 2, 4, 8]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("sizes", [(80,), (40, 40), (64, 16, 16)], ids=["S1", "S2", "S3gqa"])
def test_expand_mixed_slots(dtype, R, sizes):
    # The split count cycles through 1/2/4/8 over the (R, S) grid.
    splits = SPLITS[(RANKS.index(R) + len(sizes)) % len(SPLITS)]
    gen = torch.Generator().manual_seed(R * 3 + len(sizes))
    T = 11
    run_and_check(T, sizes, R, dtype, mixed_slots(T, NUM_SLOTS, gen), gen, splits=splits)


@pytest.mark.parametrize("splits", [3, 32])
def test_expand_sums_many_or_odd_splits(splits):
    # 32 at R=64: the partials are summed in several groups; 3: a masked, partial group.
    gen = torch.Generator().manual_seed(splits)
    run_and_check(7, (48, 16), 64, torch.float32, mixed_slots(7, NUM_SLOTS, gen), gen,
                  splits=splits)


@pytest.mark.slow  # 2049 output columns, interpreted
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("sizes", [(2049,), (1000, 1049), (33, 17, 2049 - 50)])
def test_expand_odd_output_size(dtype, sizes):
    gen = torch.Generator().manual_seed(sum(sizes) + len(sizes))
    T = 6
    run_and_check(T, sizes, 16, dtype, mixed_slots(T, NUM_SLOTS, gen), gen, splits=4)


def test_expand_many_tokens_one_slot():
    gen = torch.Generator().manual_seed(1)
    slots = torch.full((37,), 1, dtype=torch.int32)
    slots[::4] = -1
    run_and_check(37, (24, 8), 8, torch.float32, slots, gen, splits=2)


def test_expand_rank_128():
    gen = torch.Generator().manual_seed(5)
    run_and_check(5, (48,), 128, torch.float16, mixed_slots(5, NUM_SLOTS, gen), gen, splits=2)


def test_expand_no_lora_tokens_is_a_no_op():
    gen = torch.Generator().manual_seed(2)
    run_and_check(5, (16, 16), 16, torch.float32, torch.full((5,), -1, dtype=torch.int32), gen)


def test_expand_rejects_bad_arguments():
    meta = LoRAKernelMeta.allocate(8, NUM_SLOTS, DEVICE)
    buf = torch.randn(1, 2, 4, 8, device=DEVICE)
    b = torch.randn(NUM_SLOTS, 32, 8, device=DEVICE)
    y = torch.randn(4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="expected"):
        lora_expand(buf[0], b, y, (0, 16, 32), meta)  # the pre-split 3-D layout
    with pytest.raises(ValueError, match="splits"):
        lora_expand(buf.expand(33, 2, 4, 8), b, y, (0, 16, 32), meta)
    with pytest.raises(ValueError, match="slice_offsets"):
        lora_expand(buf, b, y, (0, 16), meta)
    with pytest.raises(ValueError, match="slice_offsets"):
        lora_expand(buf, b, y, (0, 16, 30), meta)
    with pytest.raises(ValueError, match="dtype"):
        lora_expand(buf, b, y.half(), (0, 16, 32), meta)
    with pytest.raises(ValueError, match="buf must be float32"):
        lora_expand(buf.half(), b, y, (0, 16, 32), meta)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8, 64, 256])
@pytest.mark.parametrize("R", [16, 64])
@pytest.mark.parametrize("sizes", [(4096,), (4096, 1024, 1024), (11008, 11008)],
                         ids=["o4096", "qkv_gqa", "gate_up22016"])
@pytest.mark.parametrize("splits", [1, 16])
def test_expand_bf16_realistic(T, R, sizes, splits):
    gen = torch.Generator().manual_seed(T + R)
    run_and_check(T, sizes, R, torch.bfloat16, mixed_slots(T, NUM_SLOTS, gen), gen, T_max=512,
                  splits=splits)
