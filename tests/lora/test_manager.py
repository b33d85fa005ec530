"""Slot manager: eager validation, stacked weights in place, LRU slots and CPU cache."""
import pytest
import torch

from batchrun.errors import AdapterError
from batchrun.engine.lora.manager import MAX_SHRINK_SPLITS, LoRAManager
from tests.helpers.adapters import FakeLlama, make_adapter

TARGETS = [["q_proj", "v_proj"], ["o_proj"], ["gate_proj", "down_proj"], "all-linear", ["k_proj"]]


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    root = tmp_path_factory.mktemp("five")
    paths = {}
    for i, tm in enumerate(TARGETS):
        paths[f"a{i}"] = root / f"a{i}"
        make_adapter(paths[f"a{i}"], seed=i, r=2 + i, lora_alpha=8, target_modules=tm)
    return paths


def _manager(mcfg, paths, **kw):
    model = FakeLlama(mcfg)
    kw = {"max_loras": 2, "max_lora_rank": 8, "max_num_tokens": 16, "device": "cpu",
          "dtype": torch.float32, **kw}
    return model, LoRAManager(model, paths, **kw)


def _assert_slot_holds(m, mcfg, name, path, slot):
    """Slot `slot` of every hook holds adapter `name`'s A and B (zero padded past its rank, zero
    where it targets nothing)."""
    from batchrun.engine.lora import load_adapter
    w = load_adapter(name, path, mcfg, 8).weights
    for (layer, module), h in m.hooks.items():
        for s in range(h.num_slices):
            lo, hi = h.slice_offsets[s], h.slice_offsets[s + 1]
            a, b = h.lora_a[s, slot], h.lora_b[slot, lo:hi]
            if (layer, module, s) in w:
                wa, wb = w[(layer, module, s)]
                r = wa.shape[0]
                assert torch.equal(a[:r], wa) and torch.equal(b[:, :r], wb)
                assert not a[r:].any() and not b[:, r:].any()  # zero padding
            else:
                assert not a.any() and not b.any()


def test_lru_slots(mcfg, five):
    model, m = _manager(mcfg, five, max_cpu_loras=2)
    assert m.names == frozenset(five)
    assert m.rank == 6  # largest adapter rank, not max_lora_rank
    assert m.can_acquire("a0") and m.acquire("a0") == 0
    assert m.acquire("a1") == 1
    assert m.acquire("a0") == 0 and m.pinned("a0") == 2  # resident: no reload
    assert m.num_loads == 2
    assert not m.can_acquire("a2")
    with pytest.raises(RuntimeError, match="all 2 LoRA slots are pinned"):
        m.acquire("a2")
    m.release("a1")
    assert m.can_acquire("a2")
    assert m.acquire("a2") == 1 and m.slot_of("a2") == 1  # evicts the unpinned a1
    with pytest.raises(KeyError):
        m.slot_of("a1")
    m.release("a0"), m.release("a0"), m.release("a2")
    # a0 acquired less recently than a2 -> a0 is evicted for a3
    assert m.acquire("a3") == 0
    m.release("a3")
    assert m.num_loads == 4
    # CPU cache holds 2 (a2, a3): a1 comes from disk again, a3 would not
    m.acquire("a1")
    assert m.num_loads == 5
    with pytest.raises(RuntimeError, match="without a matching acquire"):
        m.release("a0")
    with pytest.raises(KeyError, match="unknown LoRA adapter 'zz'"):
        m.acquire("zz")


def test_active_adapters_are_kept_in_the_lowest_slots(mcfg, five):
    """An adapter that becomes active takes the lowest slot that is free or holds an unpinned
    adapter (swapping contents with it), so the slot bound of a step with few active adapters
    stays small. Every adapter's weights follow it to its new slot."""
    _, m = _manager(mcfg, five, max_loras=4)

    def check_contents():
        for name, slot in m._resident.items():
            _assert_slot_holds(m, mcfg, name, five[name], slot)

    assert [m.acquire(n) for n in ("a0", "a1", "a2")] == [0, 1, 2] and m.num_moves == 0
    m.release("a0"), m.release("a1")
    # a newly loaded adapter: the free slot 3 is not the lowest one not in use (a0's slot 0):
    # a0 moves up into slot 3, a3 is written into slot 0
    assert m.acquire("a3") == 0 and m.slot_of("a0") == 3 and m.num_moves == 1
    check_contents()
    # a resident adapter becoming active: a1 (slot 1) is the lowest not in use, a0 swaps in
    assert m.acquire("a0") == 1 and m.slot_of("a1") == 3 and m.num_moves == 2
    check_contents()
    # already active (pinned): it stays where running sequences expect it
    assert m.acquire("a0") == 1 and m.num_moves == 2
    m.release("a0"), m.release("a0"), m.release("a2"), m.release("a3")
    # a full set of slots, none pinned: the LRU victim's slot is taken, then the new adapter
    # goes lowest (a3, slot 0, moves into the victim's slot)
    victim = next(iter(m._resident))
    victim_slot = m.slot_of(victim)
    assert m.acquire("a4") == 0 and m.slot_of("a3") == victim_slot
    check_contents()
    assert m.slot_bound(0) == 1 and m.slot_bound(1) == 4 and m.slot_bound(2) == 4
    assert m.slot_bound(3) == 4 and m.slot_bounds == (1, 4)
    with pytest.raises(ValueError, match="outside"):
        m.slot_bound(4)


@pytest.mark.parametrize("max_loras,bounds", [(1, (1,)), (2, (1, 2)), (3, (1, 3)),
                                              (5, (1, 5)), (8, (1, 8))])
def test_slot_bounds(tmp_path, mcfg, max_loras, bounds):
    make_adapter(tmp_path / "one", r=2, target_modules=["q_proj"])
    _, m = _manager(mcfg, {f"a{i}": tmp_path / "one" for i in range(8)}, max_loras=max_loras)
    assert m.slot_bounds == bounds
    for top in range(max_loras):
        k = m.slot_bound(top)
        assert k > top and k in bounds and not any(top < b < k for b in bounds)
    step = m.lora_step([-1, top, 0])  # the bound of the highest slot, from a host list
    assert step.num_slots == m.slot_bound(top)
    assert m.lora_step(torch.tensor([0, -1])).num_slots == 1  # a CPU tensor: computed too
    with pytest.raises(ValueError, match="num_slots"):
        m.lora_step([0], num_slots=max_loras + 1)


def test_cpu_cache_unbounded(mcfg, five):
    _, m = _manager(mcfg, five, max_loras=1)
    for _ in range(2):
        for name in five:
            m.acquire(name)
            m.release(name)
    assert m.num_loads == 5


def test_slot_contents(mcfg, five):
    model, m = _manager(mcfg, five)
    hooked = {(i, n) for i, layer in enumerate(model.model.layers)
              for n, lin in [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                             ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]
              if lin.lora is not None}
    assert hooked == set(m.hooks)
    ptrs = {k: (h.lora_a.data_ptr(), h.lora_b.data_ptr()) for k, h in m.hooks.items()}
    for name in ["a3", "a0", "a1", "a2", "a4", "a3"]:  # a0 (q,v) overwrites all-linear a3's slot
        slot = m.acquire(name)
        m.release(name)
        _assert_slot_holds(m, mcfg, name, five[name], slot)
    assert ptrs == {k: (h.lora_a.data_ptr(), h.lora_b.data_ptr()) for k, h in m.hooks.items()}


def test_only_targeted_linears_hooked(tmp_path, mcfg):
    make_adapter(tmp_path / "qv", target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    model, m = _manager(mcfg, {"qv": tmp_path / "qv"})
    assert set(m.hooks) == {(1, "qkv_proj")}
    assert model.model.layers[0].self_attn.qkv_proj.lora is None
    assert m.shrink_buffer.shape == (MAX_SHRINK_SPLITS * 3 * 16 * 8,)  # flat: splits x S x T x R


def test_eager_validation(tmp_path, mcfg):
    make_adapter(tmp_path / "good")
    make_adapter(tmp_path / "dora", use_dora=True)
    model = FakeLlama(mcfg)
    with pytest.raises(AdapterError, match="'bad'.*use_dora"):
        LoRAManager(model, {"good": tmp_path / "good", "bad": tmp_path / "dora"}, max_loras=2,
                    max_lora_rank=8, max_num_tokens=8, device="cpu", dtype=torch.float32)
    assert all(getattr(mod, "lora", None) is None for mod in model.modules())


def test_prepare_step(mcfg, five):
    _, m = _manager(mcfg, five)
    step = m.lora_step([-1, -1])
    assert step is None  # no adapter token: no LoRA part in the step
    step = m.lora_step([-1, 1, 0, 1])
    assert step is not None
    assert m.meta.token_lora_slot[:5].tolist() == [-1, 1, 0, 1, -1]
    step = m.lora_step(torch.tensor([-1, -1], dtype=torch.int32))
    assert step is None
    step = m.lora_step(torch.tensor([0, -1]))
    assert step is not None and m.meta.token_lora_slot[:2].tolist() == [0, -1]
    step = m.lora_step([-1, 0], has_lora=False)  # caller's word wins (graph dispatch decided it)
    assert step is None


def test_fused_steps_read_the_bound_slots(mcfg, five):
    _, m = _manager(mcfg, five)
    assert m.lora_step([0, 1], fuse=True).token_slots is m.meta.token_lora_slot  # unbound: the metadata
    bound = torch.full((4,), -1, dtype=torch.int32)
    before = m.meta.flat.clone()
    bound[:2] = torch.tensor([1, -1])
    step = m.lora_step([1, -1], has_lora=True, fuse=True, bound_slots=bound)
    assert step is not None and step.fuse and step.token_slots is bound
    assert torch.equal(m.meta.flat, before)  # no metadata written for a fused decode step
    with pytest.raises(ValueError, match="has_lora"):
        m.lora_step([1, -1], fuse=True, bound_slots=bound)
    step = m.lora_step([0, 1], fuse=True)  # a fused prefill: slots from the metadata
    assert step.token_slots is m.meta.token_lora_slot
    assert m.meta.token_lora_slot[:2].tolist() == [0, 1]
    step = m.lora_step([1, 0], fuse=False)  # unfused steps get the metadata
    assert m.meta.token_lora_slot[:2].tolist() == [1, 0] and not step.fuse
    with pytest.raises(ValueError, match="int32"):
        m.lora_step([], has_lora=True, fuse=True, bound_slots=torch.zeros(4, dtype=torch.int64))


def test_shrink_buffer_fits_the_kernel_split_cap():
    # The manager sizes the shared buffer without importing triton; punica views up to
    # MAX_SPLITS partials out of it.
    shrink = pytest.importorskip("batchrun.kernels.lora_shrink")
    assert MAX_SHRINK_SPLITS == shrink.MAX_SPLITS


def test_slots_capped_at_the_adapter_count(tmp_path, mcfg):
    # max_loras is a cap: the adapter set is fixed, so an engine with fewer adapters gets one
    # slot per adapter and its fused GEMM stacks only their A rows under the base weight.
    make_adapter(tmp_path / "one", r=4, target_modules="all-linear")
    model, m = _manager(mcfg, {"one": tmp_path / "one"}, max_loras=4)
    assert m.max_loras == 1 and m.meta.max_loras == 1 and m._slot_owner == [None]
    hook = m.hooks[(0, "qkv_proj")]
    linear = model.model.layers[0].self_attn.qkv_proj
    assert hook.weight_full.shape[0] == linear.out_features + 3 * 1 * 4  # N + S * slots * R
    assert hook.lora_b.shape[0] == 1
    assert m.acquire("one") == 0
    assert m.lora_step([0, -1]) is not None
    _, many = _manager(mcfg, {f"a{i}": tmp_path / "one" for i in range(3)}, max_loras=2)
    assert many.max_loras == 2  # more adapters than slots: the configured cap, LRU as before
