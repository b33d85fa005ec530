"""Where the offline workload's steps lose against their physical limit (#12: 1024 x (256 ->
128), max_num_seqs 256, max_num_batched_tokens 8192), one base engine, no LoRA:

- decode: 256 rows at a context of C tokens (C = 256, 320, 380: the start, middle and end of a
  wave), per-kernel device time of ONE eager decode step grouped as GEMM (cuBLAS or the Triton
  skinny GEMM), decode attention and the rest, with each group's rate (GEMM TFLOP/s, attention
  K/V TB/s) and the step's floor (GEMM FLOPs at the bf16 dense peak + K/V and weight bytes at
  the HBM peak); then the captured graph's replay + sync, and engine.runner.decode + sync;
- prefill: one engine.step of 32 x 256 prompt tokens (one 8192-token step), its wall time and
  its kernels grouped the same way.

    PYTHONPATH=. python3 benchmarks/offline_step_profile.py [--contexts 256,320,380]
        [--output-json F]

Model: Llama-2-7b-SHAPED, RANDOM bf16 weights. Kernel times come from the profiler on an eager
step (a graph replay hides its kernels); the replay time is the step as the engine runs it.
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from batchrun.bench.build import build_engine, random_prompts
from batchrun.bench.roofline import bf16_peak, decode_bytes_per_step, hbm_peak
from batchrun.engine.config import EngineConfig
from benchmarks.step_probe import (decode_step_profile, graph_step_us, prefill_step_us,
                                   probe_scheduler)

def group(name: str) -> str:
    low = name.lower()
    if name.startswith("_skinny") or any(k in low for k in ("gemm", "gemv", "cutlass", "nvjet",
                                                             "sm90_xmma", "splitk")):
        return "GEMM"
    if any(k in low for k in ("_paged_decode", "_merge_splits", "_prefill_kernel", "attention",
                              "flash")):
        return "attention"
    return "other"


def grouped(events) -> dict:
    tot, top = collections.Counter(), collections.Counter()
    for name, us in events:
        tot[group(name)] += us
        top[name.split("(")[0][:60]] += us
    return {"groups_us": dict(tot), "launches": len(events),
            "top_kernels_us": dict(top.most_common(12))}


def linear_flops_per_token(model) -> float:
    """2 x the multiply-adds of every projection and lm_head for one token."""
    n = sum(m.weight.numel() for m in model.modules()
            if not isinstance(m, torch.nn.Embedding) and getattr(m, "weight", None) is not None
            and m.weight.dim() == 2)
    return 2.0 * n


def decode_case(engine, rows: int, ctx: int, vocab: int, dev: str) -> dict:
    prompts = random_prompts(rows, ctx, vocab, seed=ctx)
    runs = [grouped(decode_step_profile(engine, prompts)) for _ in range(3)]
    g = {k: sorted(r["groups_us"].get(k, 0.0) for r in runs)[1] for k in ("GEMM", "attention", "other")}
    step_us, replay_us = graph_step_us(engine, prompts, None, n=30)
    b = decode_bytes_per_step(engine, rows, ctx)
    flops = linear_flops_per_token(engine.model) * rows
    hbm, peak = hbm_peak(dev), bf16_peak(dev)
    out = {"rows": rows, "context": ctx, "kernels_us": g, "launches": runs[1]["launches"],
           "top_kernels_us": runs[1]["top_kernels_us"], "graph_replay_us": replay_us,
           "runner_decode_us": step_us, **b, "gemm_flops": flops,
           "gemm_tflops": flops / (g["GEMM"] * 1e-6) / 1e12,
           "attention_tb_s": b["kv_bytes"] / (g["attention"] * 1e-6) / 1e12}
    if hbm and peak:
        # GEMMs bound by the larger of their FLOPs and their weight bytes, attention by K/V bytes
        floor = max(flops / peak, b["weights_bytes"] / hbm) + b["kv_bytes"] / hbm
        out.update(floor_us=floor * 1e6, fraction_of_floor=floor * 1e6 / replay_us,
                   gemm_fraction_of_peak=flops / (g["GEMM"] * 1e-6) / peak,
                   attention_fraction_of_hbm=b["kv_bytes"] / (g["attention"] * 1e-6) / hbm)
    return out


def prefill_case(engine, rows: int, length: int, vocab: int, dev: str) -> dict:
    from torch.profiler import ProfilerActivity, profile
    prompts = random_prompts(rows, length, vocab, seed=length + 1)
    walls = prefill_step_us(engine, prompts, n=3, warmup=1)  # asserts one step holds them all
    with probe_scheduler(engine, prompts) as sched:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step(sched)
            torch.cuda.synchronize()
    ev = [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]
    r = grouped(ev)
    flops = linear_flops_per_token(engine.model) * rows * length
    peak = bf16_peak(dev)
    out = {"rows": rows, "length": length, "wall_us": sorted(walls)[len(walls) // 2],
           "kernels_us": r["groups_us"], "launches": r["launches"],
           "top_kernels_us": r["top_kernels_us"], "gemm_flops": flops,
           "gemm_tflops": flops / (r["groups_us"].get("GEMM", 1) * 1e-6) / 1e12}
    if peak:
        out["gemm_fraction_of_peak"] = out["gemm_tflops"] * 1e12 / peak
        out["fraction_of_matmul_floor"] = flops / peak / (out["wall_us"] * 1e-6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--contexts", default="256,320,380")
    ap.add_argument("--output-json")
    a = ap.parse_args()
    cfg = EngineConfig(model=a.model, max_num_seqs=a.rows, max_num_batched_tokens=8192,
                       max_model_len=384, enable_prefix_caching=False)
    built = build_engine(cfg)
    engine = built.engine
    dev = torch.cuda.get_device_name()
    vocab = engine.model.config.vocab_size
    decode = [decode_case(engine, a.rows, int(c), vocab, dev) for c in a.contexts.split(",")]
    prefill = prefill_case(engine, 32, 256, vocab, dev)
    print(f"RANDOM weights ({a.model} shape), {dev}; one eager step's kernels (profiler), µs")
    print(f"{'decode rows x ctx':>18}{'GEMM':>9}{'attn':>9}{'other':>8}{'replay':>9}{'floor':>9}"
          f"{'of floor':>9}{'GEMM TF/s':>10}{'attn TB/s':>10}")
    for d in decode:
        k = d["kernels_us"]
        print(f"{d['rows']:>12} x {d['context']:<4}{k['GEMM']:>9.0f}{k['attention']:>9.0f}"
              f"{k['other']:>8.0f}{d['graph_replay_us']:>9.0f}{d.get('floor_us', float('nan')):>9.0f}"
              f"{d.get('fraction_of_floor', float('nan')):>9.1%}{d['gemm_tflops']:>10.0f}"
              f"{d['attention_tb_s']:>10.2f}")
    k = prefill["kernels_us"]
    print(f"prefill 32 x 256: wall {prefill['wall_us']:.0f} µs; GEMM {k.get('GEMM', 0):.0f}, attention "
          f"{k.get('attention', 0):.0f}, other {k.get('other', 0):.0f} µs in {prefill['launches']} "
          f"launches; GEMM {prefill['gemm_tflops']:.0f} TFLOP/s "
          f"({prefill.get('gemm_fraction_of_peak', float('nan')):.1%} of the bf16 dense peak); the "
          f"step at {prefill.get('fraction_of_matmul_floor', float('nan')):.1%} of its matmul floor")
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(
            {"benchmark": "offline_step_profile", "weights": built.weights, "model": a.model,
             "device": dev, "decode": decode, "prefill": prefill}, indent=1))


if __name__ == "__main__":
    main()
