import pytest
import torch

from batchrun.kernels.lora_meta import LoRAKernelMeta
from kernel_testutils import DEVICE, mixed_slots


def check_meta(meta: LoRAKernelMeta, slots: torch.Tensor) -> None:
    # Invariants the kernels rely on, checked against a plain Python grouping.
    T = slots.shape[0]
    L = meta.max_loras
    tok_slot = meta.token_lora_slot.cpu()
    assert torch.equal(tok_slot[:T], slots.cpu())
    assert (tok_slot[T:] == -1).all()
    sorted_ids = meta.sorted_token_ids.cpu().tolist()
    assert sorted(sorted_ids) == list(range(meta.max_tokens))  # a permutation
    active = meta.active_slots.cpu().tolist()
    count = meta.slot_token_count.cpu().tolist()
    start = meta.slot_token_start.cpu().tolist()
    present = sorted({int(s) for s in slots.tolist() if s >= 0})
    assert active[:len(present)] == present
    assert all(a == -1 for a in active[len(present):])
    assert len(active) == L + 1
    for e, slot in enumerate(active):
        if slot < 0:
            assert count[e] == 0
            continue
        expect = [t for t in range(T) if slots[t] == slot]  # stable: ascending token order
        assert sorted_ids[start[e]:start[e] + count[e]] == expect


@pytest.mark.parametrize("T", [1, 7, 33])
@pytest.mark.parametrize("num_slots", [1, 4])
def test_prepare_groups_tokens_by_slot(T, num_slots):
    gen = torch.Generator().manual_seed(T * 10 + num_slots)
    meta = LoRAKernelMeta.allocate(max_tokens=40, max_loras=4, device=DEVICE)
    slots = mixed_slots(T, num_slots, gen)
    meta.prepare(slots.to(DEVICE))
    check_meta(meta, slots)


def test_prepare_rewrites_in_place_and_clears_stale_tokens():
    gen = torch.Generator().manual_seed(0)
    meta = LoRAKernelMeta.allocate(max_tokens=16, max_loras=4, device=DEVICE)
    ptrs = [t.data_ptr() for t in (meta.token_lora_slot, meta.sorted_token_ids, meta.active_slots,
                                   meta.slot_token_count, meta.slot_token_start)]
    meta.prepare(torch.full((16,), 3, dtype=torch.int32))   # from CPU, any device is fine
    slots = mixed_slots(5, 2, gen)
    meta.prepare(slots)
    check_meta(meta, slots)                                 # tokens 5.. from the first call are gone
    assert ptrs == [t.data_ptr() for t in (meta.token_lora_slot, meta.sorted_token_ids,
                                           meta.active_slots, meta.slot_token_count,
                                           meta.slot_token_start)]


@pytest.mark.parametrize("fill", [-1, 0, 3])
def test_prepare_uniform_batches(fill):
    meta = LoRAKernelMeta.allocate(max_tokens=8, max_loras=4, device=DEVICE)
    slots = torch.full((6,), fill, dtype=torch.int32)
    meta.prepare(slots)
    check_meta(meta, slots)
    if fill == -1:  # no LoRA token: every entry unused, kernels do no work
        assert (meta.active_slots == -1).all()


def test_prepare_rejects_too_many_tokens():
    meta = LoRAKernelMeta.allocate(max_tokens=4, max_loras=2, device=DEVICE)
    with pytest.raises(ValueError, match="exceed"):
        meta.prepare(torch.zeros(5, dtype=torch.int32))


@pytest.mark.parametrize("T", [1, 7, 33, 40])
@pytest.mark.parametrize("num_slots", [1, 4])
def test_prepare_host_equals_prepare(T, num_slots):
    gen = torch.Generator().manual_seed(T * 7 + num_slots)
    slots = mixed_slots(T, num_slots, gen)
    a = LoRAKernelMeta.allocate(max_tokens=40, max_loras=4, device=DEVICE)
    b = LoRAKernelMeta.allocate(max_tokens=40, max_loras=4, device=DEVICE)
    a.prepare(slots.to(DEVICE))
    b.flat.fill_(12345)  # poison: prepare_host must write every field
    b.prepare_host(slots.tolist())
    check_meta(b, slots)
    assert torch.equal(a.flat.cpu(), b.flat.cpu())
