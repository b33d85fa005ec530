"""`bench lora-matrix`'s numbers: per-scenario summaries against their baselines (ratios,
paired per-round slowdowns, comparability), and the verdicts against the --target-* budgets."""
from __future__ import annotations

from batchrun.bench import comparable
from batchrun.bench.timing import paired_slowdown, percentile

# Budgets each verdict is judged against (the --target-* flags): slowdown vs LoRA disabled in %
# (graphs vs graphs), graph-pool memory ratio, capture seconds.
DEFAULT_TARGETS = {"lora_enabled_0_active": 0.5, "lora_1_active": 8.0, "many_active": 15.0,
                   "memory_ratio": 1.15, "capture_s": 20.0}


def _summaries(scs: list, lat: dict[str, list[float]], output_len: int,
               counts: dict[str, list[tuple[int, int]]] | None = None,
               kv_blocks: dict[str, int] | None = None) -> dict:
    out = {}
    for sc in scs:
        xs = lat[sc.name]
        if not xs:
            continue
        avg = sum(xs) / len(xs)
        cs = (counts or {}).get(sc.name)
        out[sc.name] = {"engine": sc.engine, "graphs": sc.graphs, "active_adapters": sc.active,
                        "baseline": sc.base, "n": len(xs), "avg": avg,
                        "kv_blocks": (kv_blocks or {}).get(sc.engine),
                        "preemptions": sum(c[0] for c in cs) if cs else None,
                        "recomputed_tokens": sum(c[1] for c in cs) if cs else None,
                        "p50": percentile(xs, 50), "p90": percentile(xs, 90),
                        "min": min(xs), "ms_per_token_incl_prefill": avg / output_len * 1e3,
                        "latencies": xs}
    for s in out.values():
        base = out.get(s["baseline"])
        if base:
            s["ratio_avg"] = s["avg"] / base["avg"]
            s["ratio_p50"] = s["p50"] / base["p50"]
            s["slowdown_pct_avg"] = (s["ratio_avg"] - 1) * 100
            s["slowdown_pct_p50"] = (s["ratio_p50"] - 1) * 100
    _add_paired_to_scenarios(out)
    if kv_blocks is not None:
        comparable.apply(out, kv_blocks)
    return out


def _add_paired_to_scenarios(scenarios: dict) -> None:
    # each scenario against its baseline, where both ran in the same rounds
    for s in scenarios.values():
        base = scenarios.get(s["baseline"])
        if base is not None and base is not s and len(base["latencies"]) == len(s["latencies"]):
            s.update(paired_slowdown(base["latencies"], s["latencies"]))


def _paired_fields(scenario: dict) -> dict:
    return {k: scenario.get(k) for k in ("paired_slowdown_pct_median", "paired_slowdown_pct_ci95")}


def add_paired(result: dict) -> dict:
    """Recompute the paired statistics of a saved matrix JSON (files written before they
    existed) in place, from its per-round latencies; returns it."""
    sc = result["scenarios"]
    _add_paired_to_scenarios(sc)
    for name, t in result.get("summary", {}).items():
        if name in sc and "target_pct" in t:
            t.update(_paired_fields(sc[name]))
    return result


def _targets(result: dict, have_graphs: bool, max_loras: int, targets: dict | None = None) -> dict:
    """Each verdict against its budget (``targets``: MatrixParams.targets, the --target-* flags;
    graph scenarios only, eager is for comparison). ``scenarios`` are matrix.Scenario."""
    TARGETS = targets or DEFAULT_TARGETS
    sc, out = result["scenarios"], {}
    for name, key in (("lora_enabled_0_active", "lora_enabled_0_active"),
                      ("lora_1_active", "lora_1_active"),
                      (f"lora_{max_loras}_active", "many_active")):
        if name in sc and "slowdown_pct_p50" in sc[name]:
            v = sc[name]["slowdown_pct_p50"]
            ok = sc[name].get("comparable", True)
            out[name] = {"slowdown_pct_p50": v, "slowdown_pct_avg": sc[name]["slowdown_pct_avg"],
                         **_paired_fields(sc[name]),
                         "graphs": sc[name]["graphs"], "target_pct": TARGETS[key],
                         "comparable": ok,
                         "not_comparable_reasons": sc[name].get("not_comparable_reasons", []),
                         "met": v <= TARGETS[key] if ok else None}
    ga, gb = result["graphs"]["A"], result["graphs"]["B"]
    if have_graphs and ga.get("enabled") and gb.get("enabled"):
        alone = ga["pool_bytes"].get("no_lora") or 0
        both = sum(gb["pool_bytes"].values())
        ratio = both / alone if alone > 0 else None
        out["graph_memory"] = {
            "no_lora_alone_mib (engine A)": alone / (1 << 20),
            "per_set_mib (engine B)": {k: v / (1 << 20) for k, v in gb["pool_bytes"].items()},
            "both_sets_mib (engine B)": both / (1 << 20), "ratio": ratio,
            "target": TARGETS["memory_ratio"],
            "met": None if ratio is None else ratio <= TARGETS["memory_ratio"]}
        out["capture"] = {"A_no_lora_s": ga["capture_s"], "B_both_sets_s": gb["capture_s"],
                          "target_s": TARGETS["capture_s"],
                          "met": gb["capture_s"] <= TARGETS["capture_s"]}
    return out
