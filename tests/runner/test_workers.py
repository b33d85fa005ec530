"""`batchrun run --workers N / --gpus ...` (batchrun/job/launch/workers.py): GPU binding with fake device
lists, the worker-side device check, exit codes, and N CPU workers finishing one job."""
import os
import signal
import subprocess
import sys
import time

import pytest

from batchrun.errors import ConfigError
from batchrun.job.exit_codes import ExitCode
from batchrun.job.launch.workers import GPU_ENV, check_worker_device, pick_gpus, run_workers, visible_gpus, worst
from tests.helpers.faults import assert_every_id_once, commits, wait_for
from tests.helpers.jobs import demo_rows, HERE, REPO, read_output

FAKE = [sys.executable, str(HERE / "fake_cli.py")]


def test_gpu_lists_bind_one_worker_per_device():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert visible_gpus({}, count=lambda: 4) == ["0", "1", "2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, count=lambda: 4) == []
    assert pick_gpus("all", None, ["0", "1", "2"]) == ["0", "1", "2"]
    assert pick_gpus("1,2", None, ["0", "1", "2"]) == ["1", "2"]
    assert pick_gpus("1", 1, ["0", "1"]) == ["1"]
    assert pick_gpus(None, 3, []) == [None, None, None]
    with pytest.raises(ConfigError, match="device.s. 5 not visible on this node .visible: 0, 1."):
        pick_gpus("0,5", None, ["0", "1"])
    with pytest.raises(ConfigError, match="no GPU is visible"):
        pick_gpus("all", None, [])
    with pytest.raises(ConfigError, match="distinct device ids"):
        pick_gpus("1,1", None, ["0", "1"])
    with pytest.raises(ConfigError, match="--workers 3 and --gpus '0,1' .2 devices. disagree"):
        pick_gpus("0,1", 3, ["0", "1"])


def test_a_worker_checks_it_sees_exactly_its_gpu():
    check_worker_device({}, count=lambda: 8)  # not a bound worker: nothing to check
    check_worker_device({GPU_ENV: "3", "CUDA_VISIBLE_DEVICES": "3"}, count=lambda: 1)
    with pytest.raises(ConfigError, match="bound to GPU 3 sees CUDA_VISIBLE_DEVICES='0,1'"):
        check_worker_device({GPU_ENV: "3", "CUDA_VISIBLE_DEVICES": "0,1"}, count=lambda: 2)
    with pytest.raises(ConfigError, match="sees 0 CUDA devices .expected exactly 1."):
        check_worker_device({GPU_ENV: "7", "CUDA_VISIBLE_DEVICES": "7"}, count=lambda: 0)


def test_exit_code_is_the_worst():
    assert worst([0, 0, 0]) == 0
    assert worst([0, 4, 0]) == 4
    assert worst([0, -9, 3]) == 137
    assert worst([130, 0]) == 130


def _env(**kw):
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "TOKENIZERS_PARALLELISM": "false", **kw}


@pytest.mark.slow
def test_workers_bound_to_gpus_this_cpu_machine_lacks_refuse(make_job, tmp_path, capfd):
    job = make_job(demo_rows(12))
    lines = []
    code = run_workers([*FAKE, "run", str(job), "--progress", "none"], ["5", "6", "7"], str(tmp_path / "out"),
                       log=lines.append, interval=0.2, env=_env())
    assert "workers: started 3 (gpu 5, gpu 6, gpu 7)" in lines[0]
    assert code == 3  # each child checked its binding: CUDA_VISIBLE_DEVICES=5 (6, 7) shows no device here
    err = capfd.readouterr().err
    for gpu in "567":
        assert f"worker bound to GPU {gpu} sees 0 CUDA devices" in err


@pytest.mark.slow
def test_cpu_workers_through_the_cli(make_job, tmp_path):
    job = make_job(demo_rows(30))
    r = subprocess.run([*FAKE, "run", str(job), "--workers", "3"], capture_output=True, text=True, timeout=120,
                       env=_env(FAKE_ENGINE_SLEEP="0.01", BATCHRUN_CLAIM_LEASE="2"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "workers: started 3 (cpu, cpu, cpu)" in r.stderr and "units 9/9 committed" in r.stderr
    assert_every_id_once(tmp_path / "out")
    r = subprocess.run([*FAKE, "run", str(job), "--workers", "2", "--task-id", "1"], capture_output=True,
                       text=True, timeout=60, env=_env())
    assert r.returncode == 2 and "drop --task-id/--num-tasks" in r.stderr


@pytest.mark.slow
def test_sigterm_stops_every_worker_with_130(make_job, tmp_path):
    job = make_job(demo_rows(30))
    proc = subprocess.Popen([*FAKE, "run", str(job), "--workers", "2", "--log-interval", "0.2"],
                            stderr=subprocess.PIPE, text=True, env=_env(FAKE_ENGINE_SLEEP="0.2"))
    wait_for(lambda: len(commits(tmp_path / "out")) >= 1, timeout=60)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err[-2000:]
    assert err.count("batchrun: summary task") == 2 and err.count("exit 130") >= 2, err[-3000:]


@pytest.mark.slow
def test_max_error_rate_reaches_the_workers_and_the_pool_exits_10(make_job, tmp_path):
    rows = demo_rows(16)
    for i in (1, 6, 11):
        rows[i]["prompt"] = "  "  # 3 of 16 error rows (18.75 %)
    job = make_job(rows)
    r = subprocess.run([*FAKE, "run", str(job), "--workers", "2", "--max-error-rate", "0.1"], capture_output=True,
                       text=True, timeout=120, env=_env(BATCHRUN_CLAIM_LEASE="2"))
    assert r.returncode == ExitCode.ERROR_RATE, r.stderr[-2000:]
    assert "3 of 16 output rows are error rows" in r.stderr
    ids = read_output(tmp_path / "out").column("id").to_pylist()
    assert sorted(ids) == list(range(16))  # the output is kept, every row once
