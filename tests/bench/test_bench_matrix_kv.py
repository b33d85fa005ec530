"""lora-matrix with equal KV budgets (#16): comparability verdicts (fake numbers), the
preemption / recomputed-token counts of a real tiny run, the throughput preset, and the LoRA
memory breakdown against sizes computed from the model shape."""
import json

from click.testing import CliRunner

from batchrun.bench import comparable
from batchrun.bench.build import build_engine
from batchrun.engine.config import EngineConfig
from batchrun.engine.envs import Experiments
from batchrun.bench.lora_memory import format_lora_memory, lora_memory
from batchrun.bench.matrix import PRESETS, apply_preset
from batchrun.bench.matrix_stats import _targets
from batchrun.bench.presets import preset_config
from batchrun.cli import main

TINY = ["--model", "tiny", "--device", "cpu", "--lora-rank", "4", "--max-loras", "2",
        "--no-eager", "--num-iters-warmup", "0"]


def _sc(engine, pre, rec, base="lora_disabled"):
    return {"engine": engine, "baseline": base, "preemptions": pre, "recomputed_tokens": rec}


def test_comparability_fake_numbers():
    scs = {"lora_disabled": _sc("A", 3, 90), "lora_enabled_0_active": _sc("B", 3, 90),
           "lora_1_active": _sc("B", 5, 90), "lora_2_active": _sc("B", 3, 91)}
    comparable.apply(scs, {"A": 100, "B": 100})
    assert "comparable" not in scs["lora_disabled"]  # the baseline itself
    assert scs["lora_enabled_0_active"]["comparable"] is True
    assert scs["lora_enabled_0_active"]["not_comparable_reasons"] == []
    one = scs["lora_1_active"]
    assert one["comparable"] is False and "preemptions differ: 5 vs 3" in one["not_comparable_reasons"][0]
    assert scs["lora_2_active"]["comparable"] is False
    assert "recomputed tokens differ" in scs["lora_2_active"]["not_comparable_reasons"][0]
    # different block counts: nothing of engine B is comparable, even with equal counts
    scs = {"lora_disabled": _sc("A", 0, 0), "lora_enabled_0_active": _sc("B", 0, 0)}
    comparable.apply(scs, {"A": 6145, "B": 5633})
    v = scs["lora_enabled_0_active"]
    assert v["comparable"] is False and "KV blocks differ: 5633" in v["not_comparable_reasons"][0]
    # missing counts are not taken as equal
    assert not comparable.comparability(_sc("B", None, None), _sc("A", 0, 0), {"A": 1, "B": 1})["comparable"]


def test_targets_withhold_verdict_when_not_comparable():
    base = {"slowdown_pct_p50": 0.0, "slowdown_pct_avg": 0.0, "graphs": True}
    result = {"graphs": {"A": {}, "B": {}}, "scenarios": {
        "lora_enabled_0_active": {**base, "slowdown_pct_p50": 0.1, "comparable": True},
        "lora_1_active": {**base, "slowdown_pct_p50": 1.0, "comparable": False,
                          "not_comparable_reasons": ["preemptions differ: 5 vs 3 in the baseline"]}}}
    t = _targets(result, have_graphs=False, max_loras=2)
    assert t["lora_enabled_0_active"]["met"] is True and t["lora_enabled_0_active"]["comparable"]
    assert t["lora_1_active"]["met"] is None and not t["lora_1_active"]["comparable"]
    assert t["lora_1_active"]["not_comparable_reasons"]


def test_apply_preset_keeps_explicit_flags():
    kw = {"preset": "throughput", "batch_size": 8, "input_len": 32, "output_len": 128,
          "max_num_seqs": None, "max_num_batched_tokens": 2048}
    out = apply_preset(kw, explicit={"input_len"})
    assert out["batch_size"] == 256 and out["max_num_seqs"] == 256
    assert out["max_num_batched_tokens"] == 8192 and out["input_len"] == 32
    assert out["target_many_active_pct"] == 10.0  # issue #16's budget at throughput batches
    kw["target_many_active_pct"] = 12.0
    assert apply_preset(kw, explicit={"target_many_active_pct"})["target_many_active_pct"] == 12.0
    assert apply_preset({**kw, "preset": None}, set()) == {**kw, "preset": None}
    assert PRESETS["latency"]["batch_size"] == 8


def test_matrix_tiny_preemptions_counted_and_equal_blocks(tmp_path):
    # 5 usable blocks of 16 tokens for 8 rows of 12 + 8 tokens: rows preempt in decode
    out = tmp_path / "m.json"
    res = CliRunner().invoke(main, ["bench", "lora-matrix", *TINY, "--batch-size", "8",
                                    "--input-len", "12", "--output-len", "8", "--num-iters", "1",
                                    "--num-kv-blocks", "6", "--output-json", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["kv_blocks"]["A"] == r["kv_blocks"]["B"] == 6
    sc = r["scenarios"]
    assert sc["lora_disabled"]["preemptions"] > 0 and sc["lora_disabled"]["recomputed_tokens"] > 0
    for name in ("lora_enabled_0_active", "lora_1_active", "lora_2_active"):
        assert sc[name]["kv_blocks"] == 6 and "comparable" in sc[name]
        same = (sc[name]["preemptions"], sc[name]["recomputed_tokens"]) == \
            (sc["lora_disabled"]["preemptions"], sc["lora_disabled"]["recomputed_tokens"])
        assert sc[name]["comparable"] is same
    assert "preempt" in res.output and "KV cache: engine A 6 blocks, engine B 6 blocks" in res.output
    assert "LoRA memory" in res.output


def test_matrix_throughput_preset_on_cpu(tmp_path):
    # the preset path with the small workload flags given explicitly: the rest comes from it
    out = tmp_path / "m.json"
    res = CliRunner().invoke(main, ["bench", "lora-matrix", *TINY, "--preset", "throughput",
                                    "--batch-size", "4", "--input-len", "8", "--output-len", "4",
                                    "--num-iters", "1", "--output-json", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    p = r["params"]
    assert p["preset"] == "throughput" and p["max_num_seqs"] == 256
    assert p["max_num_batched_tokens"] == 8192 and p["batch_size"] == 4
    assert "--max-num-seqs 256" in r["command"] and "--preset throughput" in r["command"]
    assert r["kv_blocks"]["B"] == r["kv_blocks"]["A"]
    assert all(s.get("comparable", True) for s in r["scenarios"].values())


def test_lora_memory_breakdown_matches_the_shape(tmp_path):
    cfg = preset_config("tiny")
    built = build_engine(EngineConfig(model="tiny", device="cpu", enable_lora=True, max_loras=3,
                                      max_lora_rank=8, max_num_seqs=8, max_model_len=32),
                         num_adapters=2, lora_rank=4, adapter_root=tmp_path)
    mem = lora_memory(built.engine)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    # L = 2: max_loras 3 is capped at the 2 adapters; R = the adapters' rank, not max_lora_rank
    L, R, n, fp32 = 2, 4, cfg.num_hidden_layers, 4
    # A: slices x slots x R x in; B: slots x out x R -- for qkv (3 slices), o, gate_up (2), down
    a = n * L * R * (3 * h + q + 2 * h + i) * fp32
    b = n * L * R * ((q + 2 * kv) + h + 2 * i + h) * fp32
    base = n * ((q + 2 * kv) * h + h * q + 2 * i * h + h * i) * fp32
    assert mem["slots_a"] == a and mem["slots_b"] == b and mem["stacked_base"] == base
    assert mem["workspace"] > 0 and mem["fused_buffers"] > 0 and mem["hooked_linears"] == 4 * n
    assert mem["total_extra"] == a + b + mem["fused_buffers"] + mem["workspace"]
    assert "slots A" in format_lora_memory(mem) and lora_memory(build_engine(
        EngineConfig(model="tiny", device="cpu", max_model_len=32)).engine) is None


def test_recomputed_tokens_counter(tmp_path):
    """engine.stats["recomputed_tokens"] (scheduler.num_recomputed_tokens, added for #16):
    every prefilled token is a prompt token, a recomputed one, or the one token each preempted
    decode row had sampled but not yet cached (computed by its re-prefill instead of a decode)."""
    from batchrun.bench.build import make_requests, random_prompts
    eng = build_engine(EngineConfig(model="tiny", device="cpu", max_num_seqs=8, max_model_len=32,
                                    experiments=Experiments(num_kv_blocks=6))).engine
    prefilled = []
    real = eng.runner.prefill
    eng.runner.prefill = lambda batch, *a: (prefilled.append(sum(batch.num_tokens)), real(batch, *a))[1]
    reqs = make_requests(random_prompts(8, 12, 512, seed=1), 8)
    res = eng.generate(reqs)
    assert all(r.output_tokens == 8 for r in res)
    assert eng.stats["preemptions"] > 0 and eng.stats["recomputed_tokens"] > 0
    st = eng.stats
    assert sum(prefilled) == 8 * 12 + st["recomputed_tokens"] + st["preemptions"]
