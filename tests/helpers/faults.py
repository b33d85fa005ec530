"""Shared checks for the fault-injection tests: the dataset holds each id exactly once, with the
FakeEngine's expected text, and nothing but whole part files sits in output.path."""
from __future__ import annotations

import os
import time

from tests.helpers.jobs import demo_rows, expected

N_ROWS = 30  # with rows_per_unit 4 (make_job's default): 9 units


def dataset_ids(out, n_rows: int = N_ROWS, extra_ok=()) -> list:
    names = [n for n in os.listdir(out) if n not in extra_ok]
    assert all(n == "_batchrun" or (n.startswith("part-") and n.endswith(".parquet")) for n in names), names
    parts = [os.path.join(out, n) for n in names if n.startswith("part-")]
    if not parts:
        return []
    import pyarrow.dataset as ds
    rows = ds.dataset(parts, format="parquet").to_table().to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate ids"
    prompts = {r["id"]: r for r in demo_rows(n_rows)}
    for r in rows:
        assert r["output_text"] == expected(prompts[r["id"]]["prompt"], prompts[r["id"]]["adapter"])
    return ids


def assert_every_id_once(out, n_rows: int = N_ROWS, extra_ok=()) -> None:
    assert sorted(dataset_ids(out, n_rows, extra_ok)) == list(range(n_rows))


def commits(out) -> list[str]:
    d = os.path.join(out, "_batchrun", "commits")
    return sorted(n for n in os.listdir(d) if n.startswith("unit-")) if os.path.isdir(d) else []


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def handlers_installed(pid: int) -> bool:
    """True once the process catches SIGTERM and SIGINT (read from /proc: no guessing at sleeps)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught & (1 << 14)) and bool(caught & (1 << 1))  # SIGTERM = 15, SIGINT = 2
