import pytest
import torch

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.lora_shrink import MAX_SPLITS, lora_shrink, shrink_num_splits
from batchrun.kernels.reference import ref_lora_shrink
from kernel_testutils import CPU_DTYPES, DEVICE, mixed_slots, randn, rounding_tol

NUM_SLOTS = 4


def run_and_check(T, K, R, S, dtype, slots, gen, T_max=None, splits=None, slot_major=False):
    T_max = T_max or T + 3  # buffer larger than the batch, as in the engine
    splits = splits or shrink_num_splits(T, K, S)  # forced values size the out view, as punica does
    x = randn(T, K, dtype=dtype, gen=gen)
    if slot_major:  # the engine's storage: [L, S, R, K] rows seen as a strided [S, L, R, K]
        lora_a = randn(NUM_SLOTS, S, R, K, dtype=dtype, gen=gen, scale=K ** -0.5).transpose(0, 1)
    else:
        lora_a = randn(S, NUM_SLOTS, R, K, dtype=dtype, gen=gen, scale=K ** -0.5)
    meta = LoRAKernelMeta.allocate(max_tokens=T_max, max_loras=NUM_SLOTS, device=DEVICE)
    meta.prepare(slots.to(DEVICE))
    # NaN poison: a partial the kernel fails to write would poison the sum.
    out = torch.full((splits, S, T_max, R), float("nan"), dtype=torch.float32, device=DEVICE)

    lora_shrink(x, lora_a, out, meta)

    ref = ref_lora_shrink(x, lora_a, slots)
    ref_abs = ref_lora_shrink(x.abs(), lora_a.abs(), slots)
    has = (slots >= 0).to(DEVICE)
    got = out[:, :, :T]                                    # [splits, S, T, R] partials
    assert got[:, :, has].isfinite().all()                 # every partial of a LoRA token written
    total = got.sum(0)
    tol = rounding_tol(ref_abs, torch.float32, K + splits)
    assert ((total - ref).abs() <= tol)[:, has].all(), (total - ref)[:, has].abs().max()
    # Slot -1 rows and rows past T: not a single write.
    assert got[:, :, ~has].isnan().all()
    assert out[:, :, T:].isnan().all()


RANKS = [1, 8, 16, 64]
SPLITS = [1, 2, 4, 8]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("R", RANKS)
@pytest.mark.parametrize("S", [1, 2, 3])
def test_shrink_mixed_slots(dtype, R, S):
    # The split count cycles through 1/2/4/8 over the (R, S) grid (every value, every rank and
    # every slice count, without multiplying the interpreter's time). K=96 in 8 splits:
    # 16-wide chunks, the last two empty (they must store zeros).
    splits = SPLITS[(RANKS.index(R) + S) % len(SPLITS)]
    gen = torch.Generator().manual_seed(R * 7 + S)
    T = 11
    run_and_check(T, 96, R, S, dtype, mixed_slots(T, NUM_SLOTS, gen), gen, splits=splits)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("S,R", [(3, 16), (2, 5)])
def test_shrink_slot_major_view(dtype, S, R):
    # the LoRA hook's A matrices are stored slot-major (lora/layer.py): the kernel reads them
    # through the strided [S, L, R, K] view
    gen = torch.Generator().manual_seed(S * 3 + R)
    T = 9
    run_and_check(T, 80, R, S, dtype, mixed_slots(T, NUM_SLOTS, gen), gen, splits=2,
                  slot_major=True)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("K, splits", [(2049, None), (2049, 1), (2049, 4), (1000, 2), (1000, 8)])
def test_shrink_odd_hidden_size(dtype, K, splits):
    # None = the heuristic's choice; odd K puts a masked tail in the last chunk.
    gen = torch.Generator().manual_seed(K)
    T = 6
    run_and_check(T, K, 16, 2, dtype, mixed_slots(T, NUM_SLOTS, gen), gen, splits=splits)


def test_num_splits_heuristic():
    for T in (1, 8, 16, 64, 256, 2048, 8192):
        for K in (16, 1000, 4096, 11008):
            for S in (1, 2, 3):
                n = shrink_num_splits(T, K, S)
                assert 1 <= n <= MAX_SPLITS and n & (n - 1) == 0
                assert n == 1 or K // n >= 256  # each program keeps >= 256 of K
    # Llama-2-7b decode: enough splits that each program covers 256..512 of K.
    assert shrink_num_splits(8, 4096, 3) == 16
    assert shrink_num_splits(8, 11008, 1) == 32
    # Prefill already has many programs: few or no splits.
    assert shrink_num_splits(2048, 4096, 3) <= 2
    assert shrink_num_splits(8192, 4096, 3) == 1


def test_shrink_many_tokens_one_slot():
    # > BLOCK_M tokens in one group: several m-blocks per entry, one partial.
    gen = torch.Generator().manual_seed(1)
    slots = torch.full((37,), 2, dtype=torch.int32)
    slots[::5] = -1
    run_and_check(37, 64, 8, 1, torch.float32, slots, gen, splits=2)


def test_shrink_no_lora_tokens_is_a_no_op():
    gen = torch.Generator().manual_seed(2)
    run_and_check(5, 64, 16, 3, torch.float32, torch.full((5,), -1, dtype=torch.int32), gen, splits=4)


def test_shrink_rejects_bad_arguments():
    meta = LoRAKernelMeta.allocate(8, NUM_SLOTS, DEVICE)
    x = torch.randn(4, 32, device=DEVICE)
    a = torch.randn(1, NUM_SLOTS, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        lora_shrink(x, a, torch.empty(1, 1, 4, 8, dtype=torch.float16, device=DEVICE), meta)
    with pytest.raises(ValueError, match="dtype"):
        lora_shrink(x.half(), a, torch.empty(1, 1, 4, 8, device=DEVICE), meta)
    with pytest.raises(ValueError, match="out must be"):
        lora_shrink(x, a, torch.empty(2, 1, 3, 8, device=DEVICE), meta)
    with pytest.raises(ValueError, match="expected"):
        lora_shrink(x, a, torch.empty(1, 4, 8, device=DEVICE), meta)  # the pre-split 3-D layout
    with pytest.raises(ValueError, match="splits"):
        lora_shrink(x, a, torch.empty(MAX_SPLITS + 1, 1, 4, 8, device=DEVICE), meta)
    with pytest.raises(ValueError, match="slots"):
        lora_shrink(x, torch.randn(1, 2, 8, 32, device=DEVICE), torch.empty(1, 1, 4, 8, device=DEVICE), meta)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8, 64, 256])
@pytest.mark.parametrize("R", [16, 64])
@pytest.mark.parametrize("S", [1, 2, 3])
@pytest.mark.parametrize("K", [4096, 11008])
def test_shrink_bf16_realistic(T, R, S, K):
    gen = torch.Generator().manual_seed(T + R + S)
    run_and_check(T, K, R, S, torch.bfloat16, mixed_slots(T, NUM_SLOTS, gen), gen, T_max=512)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 32])
def test_shrink_bf16_forced_splits(splits):
    gen = torch.Generator().manual_seed(splits)
    run_and_check(8, 11008, 16, 1, torch.bfloat16, mixed_slots(8, NUM_SLOTS, gen), gen,
                  T_max=512, splits=splits)
