"""Timing one engine.generate between two device syncs, the eager switch, and the statistics
(percentiles as numpy's linear default, the paired slowdown of one scenario against another)."""
from __future__ import annotations

import contextlib
import random
import time

import torch

PERCENTILES = (10, 25, 50, 75, 90, 99)


@contextlib.contextmanager
def eager(engine, on: bool = True):
    """Run `engine`'s decode steps without CUDA graphs inside the block (on=False: unchanged),
    through the model runner's own eager mode (one engine measures both modes on the same
    weights and KV cache)."""
    if not on:
        yield
        return
    with engine.runner.eager():
        yield


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def time_generate(engine, requests, check_len: int | None = None) -> float:
    """Seconds for one engine.generate of the whole batch, between two device syncs."""
    sync(engine)
    t0 = time.perf_counter()
    results = engine.generate(requests)
    sync(engine)
    dt = time.perf_counter() - t0
    if check_len is not None:
        for r in results:
            if r.finish_reason == "error" or r.output_tokens != check_len:
                raise RuntimeError(f"request {r.request_id}: {r.finish_reason} after "
                                   f"{r.output_tokens} tokens ({r.error}); expected {check_len}")
    return dt


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(latencies: list[float]) -> dict:
    return {"avg": sum(latencies) / len(latencies),
            "percentiles": {str(p): percentile(latencies, p) for p in PERCENTILES},
            "latencies": list(latencies)}


def paired_slowdown(base: list[float], xs: list[float], n_boot: int = 2000) -> dict:
    """Scenario vs baseline per timed round (each round runs both, so pairing cancels drift
    between rounds): median of xs[i] / base[i] - 1 in %, with a 95 % bootstrap interval of
    that median (fixed seed: the same JSON gives the same numbers)."""
    rel = sorted((x / b - 1) * 100 for b, x in zip(base, xs))
    rng = random.Random(0)
    boots = sorted(percentile(rng.choices(rel, k=len(rel)), 50) for _ in range(n_boot))
    return {"paired_slowdown_pct_median": percentile(rel, 50),
            "paired_slowdown_pct_ci95": [percentile(boots, 2.5), percentile(boots, 97.5)]}
