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
                          (["lora-matrix", "--max-num-seqs", "0"], "--max-num-seqs: must be >= 1, got 0"),
                          (["lora-matrix", "--lora-fused-max-tokens", "-1"],
                           "--lora-fused-max-tokens: must be >= 0, got -1")]:
        res = CliRunner().invoke(main, ["bench", *args, "--model", "tiny", "--device", "cpu"])
        assert res.exit_code == 2 and message in res.output, res.output
    p = ThroughputParams(preset="tiny", gpu_memory_utilization=1.5)
    try:
        p.check()
        raise AssertionError("not refused")
    except ValueError as e:
        assert str(e).startswith("--gpu-memory-utilization: must be in (0, 1]")


def test_fused_max_tokens_flag_reaches_both_engines_or_leaves_the_default():
    from batchrun.bench.latency import LatencyParams
    from batchrun.engine.config import EngineConfig
    default = EngineConfig(model="tiny").lora_fused_max_tokens
    assert MatrixParams(model="tiny").engine_config(True).lora_fused_max_tokens == default
    p = MatrixParams(model="tiny", lora_fused_max_tokens=default + 7)
    assert {p.engine_config(e).lora_fused_max_tokens for e in (False, True)} == {default + 7}
    assert p.engine_record(True)["lora_fused_max_tokens"] == default + 7  # in the result JSON
    assert LatencyParams(model="tiny", lora_fused_max_tokens=0).engine_config().lora_fused_max_tokens == 0


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
