"""Where a LoRA decode step's time goes, on engine B (LoRA enabled) with no adapter rows, 1
adapter and N adapters, next to the LoRA-disabled engine A:
- per-kernel device time of ONE eager decode step (the profiler cannot see inside graph
  replays, so launch gaps are not in these sums: kernel time only);
- the graph step: median wall time of runner.decode (host input prep + replay + sync) and of
  the bare graph replay + sync, so host-side and GPU-side costs separate;
- one prefill step per prompt length (engine.step, first-token sampling included). Engine B's
  prefill steps add their LoRA deltas in the kernels after each projection up to
  BATCHRUN_LORA_FUSED_MAX_TOKENS tokens (batchrun/engine/envs.py) and run shrink + expand
  launches above it: run once with the default and once with BATCHRUN_LORA_FUSED_MAX_TOKENS=0
  to compare the two.

  PYTHONPATH=. python3 benchmarks/lora_step_breakdown.py [--model llama-2-7b] [--batch-size 8]
      [--output-json F]

Model: Llama-2-7b-SHAPED, RANDOM bf16 weights (presets), rank-16 adapters on all 7 projections.
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
from pathlib import Path

import torch

from batchrun.bench.build import build_engine, random_prompts, round_robin
from batchrun.bench.matrix import MatrixParams
from benchmarks.step_probe import decode_step_profile, graph_step_us, prefill_step_us


def _short(name: str) -> str:
    if name.startswith("_skinny"):  # batchrun's Triton decode GEMMs (kernels/skinny_*.py)
        return name.split("(")[0][:48]
    for key in ("gemm", "gemv", "cutlass", "nvjet", "sm90"):
        if key in name.lower():
            return "GEMM (cuBLAS)"
    return name.split("(")[0][:48]


def prefill_us(engine, prompts, adapters, n: int = 8) -> float:
    """Median µs of one engine.step that prefills every prompt (and samples their first token)."""
    return sorted(prefill_step_us(engine, prompts, adapters, n))[n // 2]


def prefill_table(cases, batch: int, lens: list[int], vocab: int) -> dict:
    """One prefill step per case and prompt length."""
    out = {}
    for length in lens:
        prompts = random_prompts(batch, length, vocab, seed=length)
        for case, (engine, adapters) in cases.items():
            out[f"{case} T={batch * length}"] = prefill_us(engine, prompts, adapters)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-loras", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-lens", default="32,128",
                    help="prompt lengths for the prefill-step timings (comma separated)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="engine budget per step (default: batch-size x the longest prefill length, "
                         "so each prefill case fits one step)")
    ap.add_argument("--output-json")
    a = ap.parse_args()
    lens = [int(x) for x in a.prefill_lens.split(",") if x]
    p = MatrixParams(model=a.model, batch_size=a.batch_size, input_len=max(lens + [32]), output_len=8,
                     max_loras=a.max_loras, max_lora_rank=16, lora_rank=16,
                     max_num_batched_tokens=a.max_num_batched_tokens or max(2048, a.batch_size * max(lens + [32])),
                     max_num_seqs=max(64, a.batch_size))
    with tempfile.TemporaryDirectory() as tmp:
        eng_a = build_engine(p.engine_config(False))
        eng_b = build_engine(p.engine_config(True), p.max_loras, p.lora_rank, Path(tmp) / "adapters")
        names = sorted(eng_b.adapters)
        prompts = random_prompts(a.batch_size, 32, eng_a.engine.model.config.vocab_size, seed=0)
        cases = {"A lora_disabled": (eng_a.engine, None),
                 "B 0_active": (eng_b.engine, None),
                 "B 1_active": (eng_b.engine, round_robin(names[:1], a.batch_size)),
                 f"B {len(names)}_active": (eng_b.engine, round_robin(names, a.batch_size))}
        table = {}
        for case, (engine, adapters) in cases.items():
            runs = [decode_step_profile(engine, prompts, adapters) for _ in range(a.repeats)]
            per = collections.defaultdict(list)  # kernel -> per-run totals
            for run in runs:
                tot = collections.Counter()
                for name, us in run:
                    tot[_short(name)] += us
                for k, v in tot.items():
                    per[k].append(v)
            table[case] = {k: sorted(v)[len(v) // 2] for k, v in per.items()}  # median µs
            table[case]["launches"] = len(runs[0])
            table[case]["graph step (decode+sync)"], table[case]["graph replay+sync"] = (
                graph_step_us(engine, prompts, adapters) if engine.runner.graphs
                else (float("nan"), float("nan")))
        prefill = (prefill_table(cases, a.batch_size, lens, eng_a.engine.model.config.vocab_size)
                   if torch.cuda.is_available() else {})
    extra = ("launches", "graph step (decode+sync)", "graph replay+sync")
    kernels = sorted({k for t in table.values() for k in t if k not in extra},
                     key=lambda k: -max(t.get(k, 0) for t in table.values()))
    print("RANDOM weights; per-kernel device time of one eager decode step (median of "
          f"{a.repeats}), µs; batch {a.batch_size}")
    print(f"{'kernel':50s}" + "".join(f"{c:>18s}" for c in table))
    for k in kernels:
        print(f"{k:50s}" + "".join(f"{table[c].get(k, 0):18.1f}" for c in table))
    print(f"{'TOTAL kernel time':50s}" + "".join(
        f"{sum(v for kk, v in table[c].items() if kk not in extra):18.1f}" for c in table))
    print(f"{'launches':50s}" + "".join(f"{table[c]['launches']:18d}" for c in table))
    for k in extra[1:]:
        print(f"{k:50s}" + "".join(f"{table[c][k]:18.1f}" for c in table))
    print("prefill step (engine.step incl. first-token sampling), median µs:")
    for k, v in prefill.items():
        print(f"  {k:50s}{v:12.1f}")
    if a.output_json:
        Path(a.output_json).write_text(json.dumps({"decode": table, "prefill": prefill}, indent=1))


if __name__ == "__main__":
    main()
