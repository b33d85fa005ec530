"""Tuned kernel entries from a sweep's JSON, for a benchmark to load into the process:
"tuned": {"N,K": value}, as benchmarks/gemm_m256.py (kernels/full_rows_gemm.TUNED) and
benchmarks/narrow_gemm.py (kernels/skinny_gemm.SPLIT_TUNED) write them."""
from __future__ import annotations

import json
import sys


def load_tuned(path: str, entry) -> dict:
    """{(N, K): entry(value)} from the JSON's "tuned" map."""
    with open(path) as f:
        tuned = json.load(f)["tuned"]
    print(f"tuned entries from {path}: {tuned}", file=sys.stderr, flush=True)
    return {tuple(int(v) for v in key.split(",")): entry(val) for key, val in tuned.items()}
