"""Host time of a decode step: everything engine.step does besides the model (scheduling, the
step's inputs, sampling, appending tokens, stop checks), with the model's forward replaced by
a stub that returns fixed random logits. On a GPU this time leaves the GPU idle between
decode steps (the step waits for its tokens), so it adds to every step of a job.

    PYTHONPATH=. python3 benchmarks/host_step.py [--rows 256] [--steps 200] [--vocab 32000]

CPU only, no weights: the tiny preset's modules are built but never run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from batchrun.bench.build import build_engine, random_prompts
from batchrun.bench.matrix import MatrixParams
from benchmarks.step_probe import probe_scheduler


def host_step_us(rows: int, steps: int, vocab: int, prefix_caching: bool) -> list[float]:
    p = MatrixParams(model="tiny", batch_size=rows, input_len=8, output_len=steps + 8,
                     num_kv_blocks=rows * (steps + 16) // 16 + 64, max_loras=1,
                     max_num_batched_tokens=max(2048, rows * 8), max_num_seqs=rows,
                     device="cpu")
    cfg = dataclasses.replace(p.engine_config(False), enable_prefix_caching=prefix_caching)
    engine = build_engine(cfg).engine
    runner = engine.runner
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g)
    runner.decode_forward = lambda n, lora: logits[:n]   # the stub: no model work
    prompts = random_prompts(rows, 8, engine.model.config.vocab_size, seed=0)
    times = []
    with probe_scheduler(engine, prompts) as sched:
        for s in sched.waiting:
            s.sampling = dataclasses.replace(s.sampling, max_tokens=steps + 4)
        engine.step(sched)  # the prefill (real model, tiny)
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step(sched)
            times.append((time.perf_counter() - t0) * 1e6)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--output-json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for caching in (False, True):
        t = sorted(host_step_us(a.rows, a.steps, a.vocab, caching))
        out[f"prefix_caching_{'on' if caching else 'off'}"] = {
            "median_us": t[len(t) // 2], "p10_us": t[len(t) // 10], "p90_us": t[9 * len(t) // 10]}
        print(f"{a.rows} rows, prefix caching {'on ' if caching else 'off'}: host time per decode "
              f"step median {t[len(t) // 2]:.0f} us (p10 {t[len(t) // 10]:.0f}, "
              f"p90 {t[9 * len(t) // 10]:.0f})")
    if a.output_json:
        with open(a.output_json, "w") as f:
            json.dump({"args": vars(a), **out}, f, indent=1)


if __name__ == "__main__":
    main()
