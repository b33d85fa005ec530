"""Where one small prefill step's wall time goes (the latency workload's 8 x 32 tokens): its
wall time (engine.step, first-token sampling included) against the device time of its kernels,
and the host functions that take longest. A step far above its kernel time is host-bound.

    PYTHONPATH=. python3 benchmarks/prefill_profile.py [--batch-size 8] [--input-len 32]
        [--active-adapters N] [--output-json F]

Model: Llama-2-7b-SHAPED, RANDOM bf16 weights (preset). LoRA disabled, or with
--active-adapters N a LoRA engine (8 rank-16 slots, all 7 projections) whose rows run N
adapters round-robin (the latency matrix's "1 active" / "8 active" prefill).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from batchrun.bench.build import build_engine, random_prompts, round_robin
from batchrun.bench.matrix import MatrixParams
from benchmarks.step_probe import prefill_step_us, probe_scheduler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--active-adapters", type=int, default=0,
                    help="0: LoRA disabled; N: a LoRA engine, rows over N adapters round-robin")
    ap.add_argument("--output-json")
    a = ap.parse_args()
    p = MatrixParams(model=a.model, batch_size=a.batch_size, input_len=a.input_len)
    lora = a.active_adapters > 0
    tmp = tempfile.TemporaryDirectory()  # the adapters load from here on first use: kept to the end
    built = (build_engine(p.engine_config(True), p.max_loras, p.lora_rank, Path(tmp.name) / "a")
             if lora else build_engine(p.engine_config(False)))
    engine = built.engine
    adapters = round_robin(sorted(built.adapters)[:a.active_adapters], a.batch_size) if lora else None
    prompts = random_prompts(a.batch_size, a.input_len, engine.model.config.vocab_size, seed=0)
    walls = prefill_step_us(engine, prompts, adapters, n=10)
    with probe_scheduler(engine, prompts, adapters) as sched:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step(sched)
            torch.cuda.synchronize()
    # the Python functions of one more step (cProfile): which wrappers the host time sits in
    with probe_scheduler(engine, prompts, adapters) as sched:
        torch.cuda.synchronize()
        cp = cProfile.Profile()
        cp.enable()
        engine.step(sched)
        torch.cuda.synchronize()
        cp.disable()
    py = sorted(pstats.Stats(cp).stats.items(), key=lambda kv: -kv[1][2])[:25]  # by own time
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernel_us = sum(e.device_time for e in kernels)
    by_name = collections.Counter()
    for e in kernels:
        by_name[e.name.split("(")[0][:60]] += e.device_time
    cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]
    out = {"wall_us_median": sorted(walls)[len(walls) // 2], "walls_us": walls,
           "kernel_us": kernel_us, "launches": len(kernels),
           "kernels": dict(by_name.most_common(15)),
           "cpu_self_us": {e.key[:60]: e.self_cpu_time_total for e in cpu},
           "cpu_self_calls": {e.key[:60]: e.count for e in cpu},
           "python_own_us": {f"{Path(f).name}:{ln} {fn}": (st[2] * 1e6, st[1])
                             for (f, ln, fn), st in py}}
    out["active_adapters"] = a.active_adapters
    print(f"RANDOM weights; {a.active_adapters} active adapters; prefill step "
          f"{a.batch_size} x {a.input_len}: wall median "
          f"{out['wall_us_median']:.0f} us; kernels {kernel_us:.0f} us in {len(kernels)} launches")
    for k, v in out["kernels"].items():
        print(f"  kernel {k:60s} {v:9.0f} us")
    for k, v in out["cpu_self_us"].items():
        print(f"  host   {k:60s} {v:9.0f} us  x{out['cpu_self_calls'][k]}")
    for k, (us, calls) in out["python_own_us"].items():
        print(f"  python {k[:60]:60s} {us:9.0f} us  x{calls}  (under cProfile)")
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
