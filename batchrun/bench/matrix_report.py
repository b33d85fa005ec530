"""What `batchrun bench lora-matrix` prints (also `benchmarks/show_matrix.py` for a saved JSON)."""
from __future__ import annotations

from batchrun.bench.latency import RANDOM_BANNER
from batchrun.bench.lora_memory import format_lora_memory


def print_matrix(r: dict, echo=print) -> None:
    if r["weights"] == "random":
        echo(RANDOM_BANNER.format(model=r["model"]))
    p = r["params"]
    echo(f"model {r['model']} ({r['weights']} weights), device {r['device']}, commit "
         f"{r['commit'][:12]}{' (dirty)' if r.get('git_dirty') else ''}; batch {p['batch_size']}, "
         f"input {p['input_len']}, output {p['output_len']}; adapters: {r['adapters']['count']} "
         f"x rank {r['adapters']['rank']} on q,k,v,o,gate,up,down"
         + (f"; preset {p['preset']}" if p.get("preset") else ""))
    kv = r.get("kv_blocks")
    if kv:
        echo(f"KV cache: engine A {kv['A']} blocks, engine B {kv['B']} blocks ({kv['policy']})")
    mem = r.get("memory", {})
    if "B" in mem:
        echo(format_lora_memory(mem["B"].get("lora_breakdown_bytes"),
                                mem.get("lora_measured_extra_bytes")))
    pk = r.get("profile_kernels")
    if pk:
        verdict = "PASS" if pk["passed"] else "FAIL"
        echo(f"kernel check ({pk['kind']}, one eager no-adapter decode step, LoRA engine vs "
             f"LoRA-disabled engine): {verdict} ({pk['num_kernels_B']} vs {pk['num_kernels_A']})")
        if not pk["passed"]:
            echo(f"  extra in LoRA engine: {pk['extra_in_B']}")
            echo(f"  missing in LoRA engine: {pk['missing_in_B']}")
        if pk["copies_A"] != pk["copies_B"]:
            echo(f"  (copies differ: A {pk['copies_A']} / B {pk['copies_B']})")
    s = r.get("summary", {})
    for key in ("graph_memory", "capture"):
        if key in s:
            m = s[key]
            if key == "graph_memory":
                per = ", ".join(f"{k} {v:.1f}" for k, v in m["per_set_mib (engine B)"].items())
                ratio = "n/a" if m["ratio"] is None else f"{m['ratio']:.3f}x"
                echo(f"graph pool memory: LoRA engine per set [{per}] MiB = "
                     f"{m['both_sets_mib (engine B)']:.1f} MiB vs no-LoRA set alone "
                     f"{m['no_lora_alone_mib (engine A)']:.1f} MiB -> {ratio} "
                     f"(target <= {m['target']}x: {_met(m['met'])})")
            else:
                echo(f"graph capture: LoRA engine, all sets {m['B_both_sets_s']:.2f} s, "
                     f"LoRA-disabled engine {m['A_no_lora_s']:.2f} s (target <= "
                     f"{m['target_s']:.0f} s: {_met(m['met'])})")
    echo("")
    head = f"{'scenario':<28}{'n':>4}{'avg s':>10}{'p50 s':>10}{'p90 s':>10}{'ms/tok':>9}" \
           f"{'vs base p50':>13}{'vs base ms':>12}{'vs base avg':>13}{'paired [95% CI]':>28}" \
           f"{'preempt':>9}{'recomp tok':>11}  target (p50)"
    echo(head)
    echo("-" * len(head))
    for name, sc in r["scenarios"].items():
        tgt = s.get(name)
        target = f"<= {tgt['target_pct']}%: {_met(tgt['met'])}" if tgt else ""
        if sc.get("comparable") is False:
            target = "NOT COMPARABLE (see below)"
        rel_p50 = f"{sc['slowdown_pct_p50']:+.2f}%" if "slowdown_pct_p50" in sc else ""
        rel_avg = f"{sc['slowdown_pct_avg']:+.2f}%" if "slowdown_pct_avg" in sc else ""
        paired = ""
        if "paired_slowdown_pct_median" in sc:
            lo, hi = sc["paired_slowdown_pct_ci95"]
            paired = f"{sc['paired_slowdown_pct_median']:+.2f}% [{lo:+.2f}, {hi:+.2f}]"
        # the same difference in milliseconds a request: a LoRA cost that stays put over a base
        # that gets faster shows as a larger percentage
        base = r["scenarios"].get(sc["baseline"])
        delta_ms = f"{(sc['p50'] - base['p50']) * 1e3:+.1f}" if base else ""
        if name == sc["baseline"]:
            rel_p50, delta_ms, rel_avg, paired = "(base)", "", "(base)", "(base)"
        echo(f"{name:<28}{sc['n']:>4}{sc['avg']:>10.4f}{sc['p50']:>10.4f}{sc['p90']:>10.4f}"
             f"{sc['ms_per_token_incl_prefill']:>9.3f}{rel_p50:>13}{delta_ms:>12}{rel_avg:>13}"
             f"{paired:>28}"
             f"{_fmt_count(sc.get('preemptions')):>9}{_fmt_count(sc.get('recomputed_tokens')):>11}"
             f"  {target}")
    for name, sc in r["scenarios"].items():
        if sc.get("comparable") is False:
            echo(f"NOT COMPARABLE: {name} vs {sc['baseline']}: "
                 + "; ".join(sc["not_comparable_reasons"]) + " (no target verdict)")


def _fmt_count(v) -> str:
    return "n/a" if v is None else str(v)


def _met(v) -> str:
    return "n/a" if v is None else ("met" if v else "MISSED")
