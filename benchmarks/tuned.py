"""Tuned kernel entries from a sweep's JSON, for a benchmark to load into the process:
"tuned": {"N,K": value}, as benchmarks/gemm_m256.py (kernels/full_rows_gemm.TUNED) and
benchmarks/narrow_gemm.py (kernels/skinny_gemm.SPLIT_TUNED) write them."""
from __future__ import annotations

import json
import sys


def load_tuned(path: str) -> dict:
    """{(N, K): value} from the JSON's "tuned" map, values as JSON has them (lists): the
    kernels' setters (full_rows_gemm.set_tuned, skinny_gemm.set_split_tuned) make them tuples."""
    with open(path) as f:
        tuned = json.load(f)["tuned"]
    print(f"tuned entries from {path}: {tuned}", file=sys.stderr, flush=True)
    return {tuple(int(v) for v in key.split(",")): val for key, val in tuned.items()}
