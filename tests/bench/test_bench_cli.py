"""`batchrun bench latency` and `batchrun bench lora-matrix` end to end on the tiny preset (CPU,
eager): they run, print the report and write JSON with the documented fields."""
import json

from click.testing import CliRunner

from batchrun.bench.timing import percentile
from batchrun.bench.matrix import MatrixParams, scenarios
from batchrun.cli import main

SHORT = ["--model", "tiny", "--device", "cpu", "--input-len", "8", "--output-len", "4",
         "--num-iters", "2", "--num-iters-warmup", "1"]


def _run(args):
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    return res


def test_latency_tiny_writes_json(tmp_path):
    out = tmp_path / "lat.json"
    res = _run(["bench", "latency", *SHORT, "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    assert "RANDOM WEIGHTS" in res.output and "Avg latency" in res.output
    assert "99% percentile latency" in res.output
    r = json.loads(out.read_text())
    assert r["benchmark"] == "latency" and r["weights"] == "random" and r["model"] == "tiny"
    assert r["command"].startswith("batchrun bench latency") and r["commit"]
    assert r["device"].startswith("cpu") and r["versions"]["torch"] and "triton" in r["versions"]
    assert r["params"]["batch_size"] == 8 and r["params"]["num_iters"] == 2
    assert len(r["latencies"]) == 2 and r["avg"] > 0
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert r["graphs"] == {"enabled": False}
    assert r["memory"]["weights_gib"] > 0 and r["decode_ms_per_token"] is not None
    roof = r["decode_roofline"]  # CPU: the achieved rate, no HBM peak to compare with
    assert roof["fraction_of_peak"] is None and "decode roofline" in res.output
    assert roof["bytes_per_step"] == roof["weights_bytes"] + roof["kv_bytes"] > 0
    assert abs(roof["achieved_bytes_per_s"] * r["decode_ms_per_token"] * 1e-3
               - roof["bytes_per_step"]) <= 1e-6 * roof["bytes_per_step"]


def test_latency_with_active_loras(tmp_path):
    out = tmp_path / "lat.json"
    res = _run(["bench", "latency", *SHORT, "--enable-lora", "--max-loras", "2",
                "--num-active-loras", "2", "--lora-rank", "4", "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["active_adapters"] == ["lora0", "lora1"] and r["memory"]["lora_slots_gib"] > 0


def test_latency_flag_errors():
    res = _run(["bench", "latency", *SHORT, "--num-active-loras", "2"])
    assert res.exit_code == 2 and "needs --enable-lora" in res.output
    res = _run(["bench", "latency", *SHORT, "--enable-lora", "--max-loras", "1",
                "--num-active-loras", "2"])
    assert res.exit_code == 2 and "--max-loras" in res.output


def test_lora_matrix_tiny_eager(tmp_path):
    out = tmp_path / "matrix.json"
    res = _run(["bench", "lora-matrix", *SHORT, "--max-loras", "4", "--lora-rank", "4",
                "--profile-kernels", "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    assert "kernel check" in res.output and "PASS" in res.output
    r = json.loads(out.read_text())
    sc = r["scenarios"]
    assert list(sc) == ["lora_disabled", "lora_enabled_0_active", "lora_1_active", "lora_4_active"]
    assert all(s["n"] == 2 and not s["graphs"] for s in sc.values())
    assert sc["lora_4_active"]["active_adapters"] == 4 and "ratio_p50" in sc["lora_1_active"]
    assert r["profile_kernels"]["passed"] and r["profile_kernels"]["num_kernels_A"] > 0
    assert len(r["rounds"]) == 2 and r["rounds"][0] != r["rounds"][1]  # rotating order
    assert r["summary"]["lora_1_active"]["target_pct"] == 8.0
    lo, hi = sc["lora_1_active"]["paired_slowdown_pct_ci95"]
    assert lo <= sc["lora_1_active"]["paired_slowdown_pct_median"] <= hi
    assert r["graphs"]["B"] == {"enabled": False} and r["weights"] == "random"
    # the table is printed last
    assert res.output.rstrip().splitlines()[-1].startswith("results written")
    assert "lora_4_active" in res.output.rstrip().splitlines()[-2]
    # each scenario's p50 also as milliseconds over the base's (what LoRA costs a request)
    row = next(ln for ln in res.output.splitlines() if ln.startswith("lora_1_active"))
    want = (sc["lora_1_active"]["p50"] - sc["lora_disabled"]["p50"]) * 1e3
    assert f"{want:+.1f}" in row.split()
    assert "vs base ms" in res.output


def test_paired_slowdown():
    from batchrun.bench.timing import paired_slowdown
    base = [1.0, 2.0, 1.0, 2.0, 1.0]  # drift between rounds that pairing cancels
    r = paired_slowdown(base, [b * 1.05 for b in base])
    assert abs(r["paired_slowdown_pct_median"] - 5.0) < 1e-9
    assert all(abs(v - 5.0) < 1e-9 for v in r["paired_slowdown_pct_ci95"])
    r = paired_slowdown(base, [1.0, 2.2, 1.0, 2.0, 1.02])
    lo, hi = r["paired_slowdown_pct_ci95"]
    assert r["paired_slowdown_pct_median"] == 0.0 and lo == 0.0 and hi > 0
    assert paired_slowdown(base, [1.0, 2.2, 1.0, 2.0, 1.02]) == r  # seeded: reproducible


def test_matrix_scenarios_with_graphs():
    p = MatrixParams(num_iters=10, num_iters_eager=4)
    names = [(s.name, s.graphs, s.iters, s.base) for s in scenarios(p, have_graphs=True)]
    assert names[:4] == [("lora_disabled", True, 10, "lora_disabled"),
                         ("lora_enabled_0_active", True, 10, "lora_disabled"),
                         ("lora_1_active", True, 10, "lora_disabled"),
                         ("lora_8_active", True, 10, "lora_disabled")]
    assert [n[0] for n in names[4:]] == ["lora_disabled_eager", "lora_enabled_0_active_eager",
                                         "lora_1_active_eager", "lora_8_active_eager"]
    assert all(n[2] == 4 and n[3] == "lora_disabled_eager" for n in names[4:])
    p.no_eager = True
    assert len(scenarios(p, have_graphs=True)) == 4


def test_percentile_matches_numpy_linear():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0 and percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert abs(percentile(xs, 10) - 1.4) < 1e-12 and abs(percentile(xs, 99) - 4.96) < 1e-12


def test_unknown_model_names_presets():
    res = _run(["bench", "latency", "--model", "llama-2-13b", "--device", "cpu"])
    assert res.exit_code == 3 and "llama-2-7b" in res.output and "neither a preset" in res.output


def test_graph_stats_report_the_prefill_graphs(tmp_path):
    """A GPU engine's decode and piecewise prefill graph stats reach the JSON and the report
    (faked: the CPU engine captures none)."""
    from types import SimpleNamespace

    from batchrun.bench.engine_stats import graph_stats
    from batchrun.bench.latency import print_latency
    decode = SimpleNamespace(stats={"capture_s": 1.5, "sizes": [1, 2, 4, 8], "num_graphs": 4,
                                    "pool_bytes": {"no_lora": 3 << 20}})
    prefill = SimpleNamespace(stats={"capture_s": 0.57, "sizes": [16, 32], "slot_bounds": [0, 8],
                                     "num_captures": 4, "pieces_per_capture": 33})
    out = tmp_path / "lat.json"
    assert _run(["bench", "latency", *SHORT, "--output-json", str(out)]).exit_code == 0
    r = json.loads(out.read_text())
    for pg in (prefill, None):
        engine = SimpleNamespace(runner=SimpleNamespace(graphs=decode, prefill_graphs=pg))
        g = graph_stats(engine)
        assert g["enabled"] and g["num_graphs"] == 4 and g["pool_mib"] == {"no_lora": 3.0}
        assert g["prefill"] == (None if pg is None else prefill.stats)
        r["graphs"] = g
        lines = []
        print_latency(r, echo=lines.append)
        text = "\n".join(lines)
        assert "CUDA graphs: 4 captured in 1.50 s, sizes [1, 2, 4, 8]" in text
        assert ("prefill graphs: off" in text if pg is None else
                "prefill graphs: 4 captures (token sizes [16, 32], LoRA slot bounds [0, 8]) of "
                "33 pieces each in 0.57 s" in text)
