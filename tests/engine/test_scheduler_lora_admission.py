"""Admission steps over a row whose adapter has no free LoRA slot (scheduler._next_admissible):
base rows and rows of resident adapters behind it run, each adapter's rows keep their order, the
look-ahead is bounded, and a KV-blocked row still stops admission."""
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.scheduler import LORA_LOOKAHEAD, Scheduler
from batchrun.engine.sequence import Sequence


class Slots:
    """LoRAManager's scheduler API over ``n`` slots: an adapter is resident while it holds a
    slot; an unpinned resident one may be evicted."""

    def __init__(self, n):
        self.n, self.pins = n, {}

    def can_acquire(self, name):
        return name in self.pins or len(self.pins) < self.n or any(p == 0 for p in self.pins.values())

    def acquire(self, name):
        if name not in self.pins and len(self.pins) >= self.n:
            del self.pins[next(k for k, p in self.pins.items() if p == 0)]
        self.pins[name] = self.pins.get(name, 0) + 1
        return list(self.pins).index(name)

    def release(self, name):
        self.pins[name] -= 1


def _sched(slots=1, blocks=1000, max_num_seqs=64):
    cfg = EngineConfig(model="m", max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, max_model_len=256)
    return Scheduler(cfg, BlockManager(blocks, 16), Slots(slots))


def _seq(i, adapter, n=4):
    return Sequence(i, f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=4), adapter, None)


def _names(seqs):
    return [s.request_id for s in seqs]


def _step(s):
    """One scheduler step as the engine runs it: computed tokens count, each sequence whose
    prompt is done gets one sampled token. Returns the step's sequences' names."""
    batch = s.schedule()
    rows = [batch.seqs[i] for i in batch.sampled]
    s.update(rows, [7] * len(rows), [None] * len(rows), [None] * len(rows))
    return _names(batch.seqs) if batch.is_prefill else ["decode"] + _names(batch.seqs)


def test_rows_behind_a_slot_wait_run_and_each_adapter_keeps_its_order():
    s = _sched(slots=1)
    s.add(_seq(0, "A"))
    assert _step(s) == ["r0"]  # A takes the only slot
    for i, adapter in enumerate(["B", None, "A", "B", None, "C"], start=1):
        s.add(_seq(i, adapter))
    assert _step(s) == ["r2", "r3", "r5"]  # base, resident A, base; B and C wait
    assert _names(s.waiting) == ["r1", "r4", "r6"]  # in their order, the first B still at the head
    for seq in list(s.running):
        if seq.adapter == "A":
            s.finish(seq, "stop")
    assert _step(s) == ["r1", "r4"]  # the slot freed: B's rows, in order; C waits
    assert _names(s.waiting) == ["r6"]


def test_the_look_ahead_is_bounded():
    s = _sched(slots=1, max_num_seqs=LORA_LOOKAHEAD + 8)
    s.add(_seq(0, "A"))
    _step(s)
    for i in range(1, LORA_LOOKAHEAD + 1):
        s.add(_seq(i, "B"))
    s.add(_seq(LORA_LOOKAHEAD + 1, None))  # one past the look-ahead: it waits
    assert _step(s) == ["decode", "r0"]
    assert len(s.waiting) == LORA_LOOKAHEAD + 1
    s.waiting.rotate(1)  # the base row now within the look-ahead
    assert _step(s) == [f"r{LORA_LOOKAHEAD + 1}"]


def test_a_row_that_does_not_fit_the_kv_blocks_still_stops_admission():
    s = _sched(slots=1, blocks=6)  # 16-token blocks
    s.add(_seq(0, "A"))
    _step(s)
    s.add(_seq(1, "B"))
    s.add(_seq(2, None, n=16 * 8))  # needs 8 blocks: more than are free
    s.add(_seq(3, None))
    assert _step(s) == ["decode", "r0"]
    assert _names(s.waiting) == ["r1", "r2", "r3"]


def test_without_lora_admission_is_first_come_first_served():
    cfg = EngineConfig(model="m", max_num_seqs=2, max_num_batched_tokens=4096, max_model_len=256)
    s = Scheduler(cfg, BlockManager(100, 16), None)
    for i in range(3):
        s.add(_seq(i, None))
    assert _step(s) == ["r0", "r1"]
