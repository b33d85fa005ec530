"""The CPU engine's intra-op thread default (engine/cpu_threads.py): one per CPU this process may
use, less one for the feeder and writer threads; OMP_NUM_THREADS wins; never raised; said once."""
import os
import sys

import pytest
import torch

from batchrun.engine import cpu_threads as ct

REAL_CGROUP_CPUS = ct.cgroup_cpus  # the fixture below stubs the module's for the other tests


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    before = torch.get_num_threads()
    for v in (*ct.EXPLICIT, "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(ct, "cgroup_cpus", lambda: None)
    monkeypatch.setattr(ct, "_reported", False)
    yield
    torch.set_num_threads(before)


def cpus(monkeypatch, n):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


def test_two_cpus_run_one_thread_beside_the_feeder_and_writer(monkeypatch):
    cpus(monkeypatch, 2)
    torch.set_num_threads(2)  # torch's own default on a 2-core machine
    assert ct.limit_cpu_threads() == 1 and torch.get_num_threads() == 1


@pytest.mark.parametrize("affinity,quota,slurm,want", [(1, None, None, 1), (8, None, None, 7), (8, 2, None, 1),
                                                       (8, 3, None, 2), (8, None, "4", 3), (16, 6, "4", 3)])
def test_the_smallest_limit_decides(monkeypatch, affinity, quota, slurm, want):
    cpus(monkeypatch, affinity)
    monkeypatch.setattr(ct, "cgroup_cpus", lambda: quota)
    if slurm:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", slurm)
    torch.set_num_threads(16)
    assert ct.limit_cpu_threads() == want and torch.get_num_threads() == want


def test_omp_num_threads_wins_and_a_lower_setting_is_kept(monkeypatch):
    cpus(monkeypatch, 8)
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert ct.limit_cpu_threads() is None and torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(1)  # e.g. an API user's torch.set_num_threads(1)
    assert ct.limit_cpu_threads() == 1 and torch.get_num_threads() == 1


def test_the_choice_is_printed_once(monkeypatch, capsys):
    cpus(monkeypatch, 4)
    torch.set_num_threads(4)
    ct.limit_cpu_threads()
    ct.limit_cpu_threads()
    err = capsys.readouterr().err
    assert err.count("batchrun: CPU engine threads: 3 (4 CPU(s) available: affinity 4;") == 1, err


@pytest.mark.parametrize("v2,v1,want", [("max 100000", None, None), ("150000 100000", None, 2),
                                        ("50000 100000", None, 1), ("400000 100000", None, 4),
                                        (None, ("-1", "100000"), None), (None, ("200000", "100000"), 2),
                                        (None, None, None), ("garbage", None, None)])
def test_cgroup_quota(tmp_path, v2, v1, want):
    p2, q1, p1 = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    if v2 is not None:
        p2.write_text(v2 + "\n")
    if v1 is not None:
        q1.write_text(v1[0] + "\n")
        p1.write_text(v1[1] + "\n")
    assert REAL_CGROUP_CPUS(str(p2), (str(q1), str(p1))) == want


@pytest.mark.parametrize("affinity,workers,want", [(2, 2, "1"), (16, 4, "3"), (8, 3, "1"), (4, 1, "3")])
def test_cpu_workers_on_one_node_share_the_cpus(tmp_path, monkeypatch, affinity, workers, want):
    from batchrun.job.launch.workers import run_workers
    cpus(monkeypatch, affinity)
    seen = tmp_path / "threads"
    cmd = [sys.executable, "-c", "import os, sys; open(sys.argv[1], 'a').write(os.environ.get('OMP_NUM_THREADS', '-') "
           "+ '\\n')", str(seen)]
    env = {k: v for k, v in os.environ.items() if k not in ct.EXPLICIT}
    assert run_workers(cmd, [None] * workers, str(tmp_path), log=lambda m: None, env=env) == 0
    assert seen.read_text().split() == [want] * workers
    seen.unlink()
    assert run_workers(cmd, [None] * workers, str(tmp_path), log=lambda m: None, env={**env, "OMP_NUM_THREADS": "5"}) == 0
    assert seen.read_text().split() == ["5"] * workers  # the user's setting wins
