"""The bench flags build the one EngineConfig (#10): its checks, named by flag; the lora-matrix
budgets are flags, not constants; the benches reach the engine through its public API."""
import ast
from pathlib import Path

from click.testing import CliRunner

from batchrun.bench.matrix import MatrixParams
from batchrun.bench.matrix_stats import _targets
from batchrun.bench.throughput import ThroughputParams
from batchrun.cli import main


def test_engine_flags_get_engine_config_checks_under_the_flag_name():
    for args, message in [(["latency", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens: must be >= 1, got 0"),
                          (["latency", "--max-lora-rank", "0"], "--max-lora-rank: must be >= 1, got 0"),
                          (["lora-matrix", "--max-num-seqs", "0"], "--max-num-seqs: must be >= 1, got 0")]:
        res = CliRunner().invoke(main, ["bench", *args, "--model", "tiny", "--device", "cpu"])
        assert res.exit_code == 2 and message in res.output, res.output
    p = ThroughputParams(preset="tiny", gpu_memory_utilization=1.5)
    try:
        p.check()
        raise AssertionError("not refused")
    except ValueError as e:
        assert str(e).startswith("--gpu-memory-utilization: must be in (0, 1]")


def test_experiment_flags_are_refused_with_their_variable():
    # the engine's experiment switches are BATCHRUN_* variables, not bench flags (a tiny model
    # and short runs: were a flag accepted, the bench would run and exit 0)
    small = ["--model", "tiny", "--device", "cpu", "--output-len", "2", "--num-iters", "1",
             "--num-iters-warmup", "0"]
    for args, message in [
            (["latency", "--no-async-scheduling", *small],
             "--no-async-scheduling: async_scheduling was removed: it is an experiment switch now, "
             "set BATCHRUN_ASYNC_SCHEDULING=0 in the environment"),
            (["latency", "--triton-decode-gemm", *small], "set BATCHRUN_TRITON_DECODE_GEMM=1"),
            (["lora-matrix", "--lora-fused-max-tokens", "64", *small, "--no-eager"],
             "set BATCHRUN_LORA_FUSED_MAX_TOKENS=64"),
            (["throughput", "--enable-mixed-steps", "--preset", "tiny", "--device", "cpu",
              "--num-prompts", "4", "--output-len", "2"], "set BATCHRUN_MIXED_STEPS=1"),
            (["throughput", "--no-async-scheduling", "--preset", "tiny", "--device", "cpu",
              "--num-prompts", "4", "--output-len", "2"], "set BATCHRUN_ASYNC_SCHEDULING=0")]:
        res = CliRunner().invoke(main, ["bench", *args])
        assert res.exit_code == 2 and message in res.output, res.output
    res = CliRunner().invoke(main, ["bench", "latency", "--help"])
    assert res.exit_code == 0 and "async-scheduling" not in res.output  # hidden


def test_experiments_come_from_the_environment_and_are_recorded(monkeypatch):
    from batchrun.bench.latency import LatencyParams
    monkeypatch.setenv("BATCHRUN_LORA_FUSED_MAX_TOKENS", "7")
    monkeypatch.setenv("BATCHRUN_NUM_KV_BLOCKS", "50")
    assert LatencyParams(model="tiny").engine_config().experiments.lora_fused_max_tokens == 7
    p = MatrixParams(model="tiny")
    for enable_lora in (False, True):  # engine A sized from memory, B given A's count
        x = p.engine_config(enable_lora).experiments
        assert x.lora_fused_max_tokens == 7 and x.num_kv_blocks is None
    assert p.engine_config(True, num_kv_blocks=40).experiments.num_kv_blocks == 40
    p = MatrixParams(model="tiny", num_kv_blocks=30)  # --num-kv-blocks: both engines
    assert {p.engine_config(e).experiments.num_kv_blocks for e in (False, True)} == {30}
    record = p.engine_record(True)  # the result JSON
    assert record["experiments"]["num_kv_blocks"] == 30
    assert record["experiments"]["lora_fused_max_tokens"] == 7


def test_matrix_targets_are_flags():
    p = MatrixParams(target_1_active_pct=2.0)
    assert p.targets["lora_1_active"] == 2.0 and p.targets["lora_enabled_0_active"] == 0.5
    result = {"graphs": {"A": {}, "B": {}}, "scenarios": {"lora_1_active": {
        "slowdown_pct_p50": 3.0, "slowdown_pct_avg": 3.0, "graphs": True, "comparable": True}}}
    assert _targets(result, False, 2)["lora_1_active"]["met"] is True  # default budget 8 %
    t = _targets(result, False, 2, p.targets)["lora_1_active"]
    assert t["target_pct"] == 2.0 and t["met"] is False
    res = CliRunner().invoke(main, ["bench", "lora-matrix", "--help"])
    assert "--target-1-active-pct" in res.output and "--target-capture-s" in res.output


def test_bench_package_does_not_reach_into_the_scheduler():
    for f in Path(__file__).resolve().parents[2].joinpath("batchrun", "bench").glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("batchrun.engine.scheduler", "batchrun.engine.sequence"), f
