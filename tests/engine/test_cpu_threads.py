"""The CPU engine uses at most one thread per core the process may run on (issue 11)."""
import os

import torch

from batchrun.engine.engine import limit_cpu_threads


def test_threads_follow_the_affinity_and_env_wins(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # e.g. --cpus-per-task=1
        assert limit_cpu_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
        assert limit_cpu_threads() == 64 and torch.get_num_threads() == 1  # never raised
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
        assert limit_cpu_threads() is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
