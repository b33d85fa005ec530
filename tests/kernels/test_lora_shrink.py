import pytest
import torch

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.lora_shrink import lora_shrink
from batchrun.kernels.reference import ref_lora_shrink
from kernel_testutils import CPU_DTYPES, DEVICE, POISON, mixed_slots, randn, rounding_tol

NUM_SLOTS = 4


def run_and_check(T, K, R, S, dtype, slots, gen, T_max=None):
    T_max = T_max or T + 3  # buffer larger than the batch, as in the engine
    x = randn(T, K, dtype=dtype, gen=gen)
    lora_a = randn(S, NUM_SLOTS, R, K, dtype=dtype, gen=gen, scale=K ** -0.5)
    meta = LoRAKernelMeta.allocate(max_tokens=T_max, max_loras=NUM_SLOTS, device=DEVICE)
    meta.prepare(slots.to(DEVICE))
    out = torch.full((S, T_max, R), POISON, dtype=torch.float32, device=DEVICE)

    lora_shrink(x, lora_a, out, meta)

    ref = ref_lora_shrink(x, lora_a, slots)
    ref_abs = ref_lora_shrink(x.abs(), lora_a.abs(), slots)
    has = (slots >= 0).to(DEVICE)
    got = out[:, :T]
    tol = rounding_tol(ref_abs, torch.float32, K)
    assert ((got - ref).abs() <= tol)[:, has].all(), (got - ref)[:, has].abs().max()
    # Slot -1 rows and rows past T: not a single write.
    assert (got[:, ~has] == POISON).all()
    assert (out[:, T:] == POISON).all()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("R", [1, 8, 16, 64])
@pytest.mark.parametrize("S", [1, 2, 3])
def test_shrink_mixed_slots(dtype, R, S):
    gen = torch.Generator().manual_seed(R * 7 + S)
    T = 11
    run_and_check(T, 96, R, S, dtype, mixed_slots(T, NUM_SLOTS, gen), gen)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("K", [2049, 1000])
def test_shrink_odd_hidden_size(dtype, K):
    gen = torch.Generator().manual_seed(K)
    T = 6
    run_and_check(T, K, 16, 2, dtype, mixed_slots(T, NUM_SLOTS, gen), gen)


def test_shrink_many_tokens_one_slot():
    # > BLOCK_M tokens in one group: several m-blocks per entry, one partial.
    gen = torch.Generator().manual_seed(1)
    slots = torch.full((37,), 2, dtype=torch.int32)
    slots[::5] = -1
    run_and_check(37, 64, 8, 1, torch.float32, slots, gen)


def test_shrink_no_lora_tokens_is_a_no_op():
    gen = torch.Generator().manual_seed(2)
    run_and_check(5, 64, 16, 3, torch.float32, torch.full((5,), -1, dtype=torch.int32), gen)


def test_shrink_rejects_bad_arguments():
    meta = LoRAKernelMeta.allocate(8, NUM_SLOTS, DEVICE)
    x = torch.randn(4, 32, device=DEVICE)
    a = torch.randn(1, NUM_SLOTS, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        lora_shrink(x, a, torch.empty(1, 4, 8, dtype=torch.float16, device=DEVICE), meta)
    with pytest.raises(ValueError, match="dtype"):
        lora_shrink(x.half(), a, torch.empty(1, 4, 8, device=DEVICE), meta)
    with pytest.raises(ValueError, match="out must be"):
        lora_shrink(x, a, torch.empty(1, 3, 8, device=DEVICE), meta)
    with pytest.raises(ValueError, match="slots"):
        lora_shrink(x, torch.randn(1, 2, 8, 32, device=DEVICE), torch.empty(1, 4, 8, device=DEVICE), meta)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8, 64, 256])
@pytest.mark.parametrize("R", [16, 64])
@pytest.mark.parametrize("S", [1, 2, 3])
def test_shrink_bf16_realistic(T, R, S):
    gen = torch.Generator().manual_seed(T + R + S)
    run_and_check(T, 4096, R, S, torch.bfloat16, mixed_slots(T, NUM_SLOTS, gen), gen, T_max=512)
