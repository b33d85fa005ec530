"""Short tables from saved `batchrun bench` result JSONs (latency, lora-matrix, throughput).

    python3 benchmarks/summary.py FILE.json ...     # one line per file: card, commit, figures
    python3 benchmarks/summary.py --table FILE.json # a lora-matrix file's whole table, with the
                                                    # paired per-round statistics recomputed
    python3 benchmarks/summary.py --ab DIR          # benchmarks/ab.sh's results: old vs new

--ab reads DIR/<run>-<old|new>-r<round>.json and prints, per run and figure, the median over
rounds of each side and new / old - 1 (for tok/s, higher is better; for seconds, lower).
Needs the repository root on PYTHONPATH for --table only.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

MATRIX_ROWS = ("lora_disabled", "lora_enabled_0_active", "lora_1_active")


def figures(d: dict) -> dict[str, float]:
    """The figures a result is judged by, by name (seconds, tok/s, %)."""
    kind = d.get("benchmark")
    if kind == "latency":
        out = {"avg s": d["avg"], "p50 s": d["percentiles"]["50"],
               "decode ms/token": d["decode_ms_per_token"]}
        roof = d.get("decode_roofline") or {}
        if roof.get("fraction_of_peak") is not None:
            out["decode of HBM peak"] = roof["fraction_of_peak"]
        return out
    if kind == "lora_matrix":
        sc = d["scenarios"]
        out = {}
        for name, s in sc.items():
            if s.get("graphs") is False:
                continue
            out[f"{name} p50 s"] = s["p50"]
            if name != s["baseline"]:
                out[f"{name} paired %"] = s.get("paired_slowdown_pct_median", s["slowdown_pct_p50"])
        preempt = [s.get("preemptions", 0) for s in sc.values()]
        out["preemptions (max)"] = max(preempt) if preempt else 0
        if d.get("profile_kernels"):
            out["kernel check passed"] = float(bool(d["profile_kernels"].get("passed")))
        return out
    if kind == "throughput":
        ea = d["engine_alone"]
        out = {"engine alone tok/s": d["throughput_tok_s"]["engine_alone"],
               "engine alone s": ea["generate_s"],
               "job generation tok/s": d["throughput_tok_s"]["job_generation"]}
        if (d.get("offline_floor") or {}).get("engine_alone_fraction") is not None:
            out["engine alone of floor"] = d["offline_floor"]["engine_alone_fraction"]
        return out
    raise ValueError(f"unknown benchmark {kind!r}")


def line(path: Path) -> str:
    d = json.loads(path.read_text())
    f = figures(d)
    shown = ", ".join(f"{k} {fmt(k, v)}" for k, v in f.items())
    return f"{path.name}: {d.get('device')}, {d.get('commit')}: {shown}"


def fmt(name: str, v: float) -> str:
    if "of HBM" in name or "of floor" in name:
        return f"{v:.1%}"
    if name.endswith("%"):
        return f"{v:+.2f}"
    if "tok/s" in name:
        return f"{v:,.0f}"
    if "preemptions" in name:
        return f"{v:.0f}"
    if "kernel check" in name:
        return "PASS" if v == 1 else "FAIL" if v == 0 else f"{v:.2f}"
    return f"{v:.4f}"


def ab_table(root: Path) -> None:
    pat = re.compile(r"^(?P<run>[a-z-]+)-(?P<side>old|new)-r(?P<round>\d+)\.json$")
    found: dict[str, dict[str, list[dict]]] = {}
    for p in sorted(root.glob("*.json")):
        m = pat.match(p.name)
        if m:
            found.setdefault(m["run"], {}).setdefault(m["side"], []).append(json.loads(p.read_text()))
    if not found:
        sys.exit(f"{root}: no <run>-<old|new>-r<round>.json files")
    for run, sides in found.items():
        card = {d.get("device") for s in sides.values() for d in s}
        commits = {side: sorted({str(d.get("commit"))[:12] for d in s}) for side, s in sides.items()}
        print(f"{run}: card {', '.join(sorted(map(str, card)))}; old {commits.get('old')}, new "
              f"{commits.get('new')}; rounds old {len(sides.get('old', []))}, new {len(sides.get('new', []))}")
        if "old" not in sides or "new" not in sides:
            print("  (one side has no result)")
            continue
        old = [figures(d) for d in sides["old"]]
        new = [figures(d) for d in sides["new"]]
        print(f"  {'figure':34}{'old':>12}{'new':>12}{'new/old-1':>11}")
        for k in old[0]:
            o = statistics.median(f[k] for f in old if k in f)
            n = statistics.median(f[k] for f in new if k in f)
            rel = ("" if k.endswith("%") or "preempt" in k or "kernel check" in k or "of HBM" in k
                   or not o else f"{n / o - 1:+.2%}")
            print(f"  {k:34}{fmt(k, o):>12}{fmt(k, n):>12}{rel:>11}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--table", action="store_true", help="print a lora-matrix file's whole table")
    ap.add_argument("--ab", type=Path, metavar="DIR", help="benchmarks/ab.sh's result folder")
    a = ap.parse_args()
    if a.ab:
        ab_table(a.ab)
    for path in a.files:
        if a.table:
            from batchrun.bench.matrix_report import print_matrix
            from batchrun.bench.matrix_stats import add_paired
            print_matrix(add_paired(json.loads(path.read_text())))
        else:
            print(line(path))


if __name__ == "__main__":
    main()
