"""The engine keeps active adapters in the lowest LoRA slots (lora/manager.py), so a job that
streams its rows shard by shard (one adapter after another, as the plan orders them) runs its
LoRA decode steps on slots 0 and 1 (mostly slot 0 alone: slot bound 1) instead of climbing to
max_loras as new adapters take fresh slots; and moving adapters between slots changes no
output."""
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from tests.helpers.adapters import save_peft_adapters
from tests.helpers.models import random_prompts, save_hf_model


def _run(tmp_path, adapters, max_loras, reqs):
    engine = Engine.from_config(
        EngineConfig(model=str(tmp_path / "base"), device="cpu", max_model_len=128,
                     max_num_seqs=4, enable_lora=True, max_loras=max_loras, max_lora_rank=8),
        adapters=adapters)
    tops = []  # the highest slot of each LoRA decode step
    decode = engine.runner.decode

    def spy(batch, prev=None):
        top = max(s.lora_slot for s in batch.seqs)
        if top >= 0:
            tops.append(top)
        return decode(batch, prev)
    engine.runner.decode = spy
    out = [r.output_token_ids for r in engine.generate(reqs)]
    return out, tops, engine.lora.num_moves


def test_shards_run_at_a_low_slot_bound_with_the_same_outputs(tmp_path):
    base = save_hf_model("llama3_gqa", tmp_path / "base")
    names = ["a0", "a1", "a2", "a3"]
    adapters = save_peft_adapters(tmp_path / "adapters", names, targets=("q_proj", "v_proj", "down_proj"))
    order = [n for n in names for _ in range(6)]  # shard by shard, 6 rows each
    prompts = random_prompts(len(order), [7], base.config.vocab_size, seed=5)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = [Request(i, p, sp, adapter=n) for i, (p, n) in enumerate(zip(prompts, order))]

    out, tops, moves = _run(tmp_path, adapters, 4, reqs)
    # 4 rows in flight: at a shard boundary two adapters run together, never more; without
    # compaction a3 would sit in slot 3 and its steps would stream all 4 slots' A rows
    assert tops and max(tops) <= 1 and tops.count(0) > len(tops) // 2, tops
    assert moves >= 1
    # one slot: every adapter goes through slot 0, evicted and reloaded, no moves at all
    one, one_tops, one_moves = _run(tmp_path, adapters, 1, reqs)
    assert set(one_tops) == {0} and one_moves == 0
    assert out == one
