"""o_proj and down_proj of small decode steps in the split-K skinny GEMM (kernels/skinny_gemm.py,
entries from benchmarks/narrow_gemm.py's JSON) against cuBLAS, priced per decode step of the
latency preset (batch 8 by default) on the LoRA-disabled engine A and the LoRA engine B with
0, 1 and 8 active adapters. On a fused LoRA step those projections then also add their delta in
the GEMM's epilogue (skinny_gemm_lora) instead of the delta launch before the norm, so the LoRA
cost (B / A) is the figure for #16's latency preset.

Each engine captures one decode graph set per setting and swaps them; rounds alternate the
order. Times are graph steps (runner.decode + sync, and the bare replay + sync), medians.

    PYTHONPATH=. python3 benchmarks/narrow_step_ab.py --narrow-configs narrow.json
        [--batch-size 8] [--rounds 3] [--output-json F]

Model: Llama-2-7b-SHAPED, RANDOM bf16 weights; rank-16 adapters on all 7 projections.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from batchrun.bench.build import build_engine, random_prompts, round_robin
from batchrun.bench.matrix import MatrixParams
from batchrun.bench.record import environment
from batchrun.kernels.skinny_gemm import set_split_tuned
from benchmarks.step_probe import graph_step_us
from benchmarks.tuned import load_tuned


def graph_sets(engine, tuned: dict) -> dict:
    """{on: the engine's decode graphs captured with (on) or without (off) the entries}."""
    runner, sets = engine.runner, {}
    for on in (True, False):
        set_split_tuned(tuned if on else {})
        runner._graphs = None
        runner.capture_graphs()
        sets[on] = runner._graphs
    return sets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--narrow-configs", required=True, help="narrow_gemm.py's JSON")
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-json")
    a = ap.parse_args()
    tuned = load_tuned(a.narrow_configs)
    p = MatrixParams(model=a.model, batch_size=a.batch_size, input_len=32, output_len=8,
                     max_loras=8, max_lora_rank=16, lora_rank=16, max_num_batched_tokens=2048,
                     max_num_seqs=max(64, a.batch_size))
    with tempfile.TemporaryDirectory() as tmp:
        eng_a = build_engine(p.engine_config(False)).engine
        built_b = build_engine(p.engine_config(True), p.max_loras, p.lora_rank,
                               Path(tmp) / "adapters")
        eng_b, names = built_b.engine, sorted(built_b.adapters)
        prompts = random_prompts(a.batch_size, 32, eng_a.model.config.vocab_size, seed=0)
        cases = {"A lora_disabled": (eng_a, None), "B 0_active": (eng_b, None),
                 "B 1_active": (eng_b, round_robin(names[:1], a.batch_size)),
                 f"B {len(names)}_active": (eng_b, round_robin(names, a.batch_size))}
        sets = {id(e): graph_sets(e, tuned) for e in (eng_a, eng_b)}
        runs = {(c, on): [] for c in cases for on in (True, False)}
        for r in range(a.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                set_split_tuned(tuned if on else {})
                for case, (engine, adapters) in cases.items():
                    engine.runner._graphs = sets[id(engine)][on]
                    runs[(case, on)].append(graph_step_us(engine, prompts, adapters))
    med = {k: tuple(statistics.median(x[i] for x in v) for i in range(2)) for k, v in runs.items()}
    base = {on: med[("A lora_disabled", on)][0] for on in (True, False)}
    print(f"RANDOM weights; batch {a.batch_size}; graph step (decode + sync) µs, median of "
          f"{a.rounds} rounds; narrow entries {tuned}")
    print(f"{'case':18s}{'cuBLAS':>10s}{'split-K':>10s}{'ratio':>8s}{'vs A, cuBLAS':>14s}"
          f"{'vs A, split-K':>15s}")
    for case in cases:
        off, on = med[(case, False)][0], med[(case, True)][0]
        print(f"{case:18s}{off:10.1f}{on:10.1f}{on / off:8.4f}{off / base[False] - 1:+14.2%}"
              f"{on / base[True] - 1:+15.2%}")
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(
            {"benchmark": "narrow_step_ab", **environment(eng_a.device, " ".join(sys.argv)),
             "weights": "random", "batch_size": a.batch_size,
             "tuned": {f"{n},{k}": v for (n, k), v in tuned.items()},
             "median_us": {f"{c} {'split' if on else 'cublas'}": v for (c, on), v in med.items()},
             "runs": {f"{c} {'split' if on else 'cublas'}": v for (c, on), v in runs.items()}},
            indent=1))


if __name__ == "__main__":
    main()
