"""Tuned kernel entries from a sweep's JSON, for a benchmark to load into the process:
"tuned": {"N,K": value}, as benchmarks/narrow_gemm.py writes them (the form of
kernels/skinny_gemm.SPLIT_TUNED)."""
from __future__ import annotations

import json
import sys


def load_tuned(path: str) -> dict:
    """{(N, K): value} from the JSON's "tuned" map, values as JSON has them (lists):
    skinny_gemm.set_split_tuned makes them tuples."""
    with open(path) as f:
        tuned = json.load(f)["tuned"]
    print(f"tuned entries from {path}: {tuned}", file=sys.stderr, flush=True)
    return {tuple(int(v) for v in key.split(",")): val for key, val in tuned.items()}
