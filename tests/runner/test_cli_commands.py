"""The CLI: exit codes, plan/status/show output, Slurm script and task-id defaults."""
import os

import pytest
from click.testing import CliRunner

import batchrun.job.run.runner as runner_mod
from batchrun.cli import ExitCode, main, slurm_task_defaults
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.jobs import demo_rows, read_output


@pytest.fixture(autouse=True)
def fake_engine(monkeypatch):
    monkeypatch.setattr(runner_mod, "load_engine", FakeEngine.from_spec)


def cli(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)


def test_run_then_status_and_show(make_job, tmp_path):
    job = make_job(demo_rows(12))
    r = cli("run", job, "--no-progress")
    assert r.exit_code == 0, r.output
    assert "task 0/1: 3 unit(s) written, 0 already done; 12 rows (0 error rows)" in r.output
    assert "job: 3/3 units, 12/12 rows, 0 error rows" in r.output
    r = cli("status", tmp_path / "out")
    assert r.exit_code == 0
    assert "units:   3/3 committed" in r.output and "rows:    12/12 written, 0 error rows" in r.output
    assert "running: none" in r.output and "complete" in r.output
    for shard in ("base", "reverse", "upper"):
        assert shard in r.output
    r = cli("show", tmp_path / "out", "--limit", "3")
    assert r.exit_code == 0
    assert "[base] id=0  prompt='hello run'\n    -> 'hello run' (stop, 9 tokens)" in r.output
    assert "[reverse] id=1  prompt='world hello'\n    -> 'olleh dlrow'" in r.output
    assert "[upper] id=2  prompt='batch xyz'\n    -> 'BATCH XYZ'" in r.output


def test_exit_codes(make_job, tmp_path):
    rows = demo_rows(6)
    rows[4]["prompt"] = None
    assert cli("run", make_job(rows, on_error="fail"), "--no-progress").exit_code == ExitCode.ROW_ERROR
    # on_error is not part of the fingerprint: switching to skip resumes after the committed units
    r = cli("run", make_job(rows, on_error="skip"), "--no-progress")
    assert r.exit_code == 0 and "1 already done" in r.output and "(1 error rows)" in r.output
    r = cli("run", make_job(rows, sampling={"max_tokens": 5}), "--no-progress")
    assert r.exit_code == ExitCode.JOB_CHANGED
    assert "batchrun: error: output.path:" in r.output and "the sampling settings" in r.output
    r = cli("run", make_job(rows, engine={"max_num_seqs": "many"}), "--no-progress")
    assert r.exit_code == ExitCode.CONFIG
    assert "engine.max_num_seqs: expected an integer, got 'many' (str)" in r.output
    assert cli("run", tmp_path / "nope.yaml").exit_code == ExitCode.CONFIG
    assert cli("run", make_job(rows), "--task-id", "3", "--num-tasks", "2").exit_code == ExitCode.USAGE
    assert cli("run").exit_code == ExitCode.USAGE
    assert cli("status", tmp_path / "data").exit_code == ExitCode.CONFIG


def test_plan_prints_shards_tokens_units_and_task_shares(make_job, tmp_path):
    rows = demo_rows(12)
    rows[5]["adapter"] = "mystery"
    rows[3]["prompt"] = ""
    r = cli("plan", make_job(rows), "--num-tasks", "2")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    table = lines[lines.index(next(l for l in lines if l.startswith("shard"))):]
    base = next(l for l in table if l.startswith("base")).split()
    assert base[1:] == ["4", str(sum(len(x["prompt"]) + 2 for x in rows if x["adapter"] is None and x["prompt"])), "1", "1"]
    assert next(l for l in table if l.startswith("mystery (unknown)")).split()[-1] == "1"
    assert "work units: 4 of up to 4 rows" in r.output
    assert any(l.startswith("task 0") for l in lines) and any(l.startswith("task 1") for l in lines)
    assert not (tmp_path / "out").exists()  # plan writes nothing
    r = cli("plan", make_job(rows, input={"prompt_column": "nope"}))
    assert r.exit_code == ExitCode.CONFIG and "input.prompt_column: column 'nope' is missing" in r.output


def test_slurm_script(make_job, tmp_path):
    job = make_job(demo_rows(3))
    r = cli("slurm", job, "--array", "4", "--partition", "gpu", "--time", "2:00:00")
    assert r.exit_code == 0, r.output
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --array=0-3" in script and "--gpus" not in script  # the job says device: cpu
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --time=2:00:00" in script
    assert script.rstrip().endswith(f"run {job}")  # task id and count: from Slurm at run time
    assert os.access(tmp_path / "job.sbatch", os.X_OK)
    r = cli("slurm", job, "--array", "2", "--submit", env={"PATH": "/nonexistent"})
    assert r.exit_code == ExitCode.CONFIG and "sbatch is not on PATH" in r.output


def test_slurm_array_env_defaults(monkeypatch, make_job, tmp_path):
    for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_STEP", "SLURM_ARRAY_TASK_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert slurm_task_defaults() == (None, None)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    assert slurm_task_defaults() == (1, 2)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "8")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_STEP", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert slurm_task_defaults() == (2, 3)
    # a run picks them up: array 4-5 -> this is task 1 of 2
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "4")
    monkeypatch.setenv("SLURM_ARRAY_TASK_STEP", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    r = cli("run", make_job(demo_rows(12)), "--no-progress")
    # since #14 units are claimed dynamically: task 1 of 2, alone, runs the whole job
    assert r.exit_code == 0 and "task 1/2: 3 unit(s) written" in r.output and "job: 3/3 units" in r.output


def test_kubernetes_indexed_job_defaults(monkeypatch, make_job, tmp_path):
    # JOB_COMPLETION_INDEX gives the task id; the count comes from the manifest's --num-tasks
    for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_STEP", "SLURM_ARRAY_TASK_COUNT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    job = make_job(demo_rows(12))
    r = cli("run", job, "--no-progress")
    assert r.exit_code == ExitCode.USAGE and "JOB_COMPLETION_INDEX=2" in r.output
    assert "--num-tasks" in r.output and "completions" in r.output
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.parquet"))
    r = cli("run", job, "--no-progress", "--num-tasks", "3")
    assert r.exit_code == 0 and "task 2/3: 3 unit(s) written" in r.output and "job: 3/3 units" in r.output
    assert sorted(x["id"] for x in read_output(tmp_path / "out").to_pylist()) == list(range(12))
    # an explicit --task-id wins; Slurm's variables win over Kubernetes'
    assert "task 0/3" in cli("run", job, "--no-progress", "--num-tasks", "3", "--task-id", "0").output
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    assert "task 1/2" in cli("run", job, "--no-progress").output


def test_slurm_siblings_restart_only_once(monkeypatch, make_job, tmp_path):
    job = make_job(demo_rows(12))
    assert cli("run", job, "--no-progress").exit_code == 0
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "777")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "0")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    assert cli("run", job, "--no-progress", "--restart").exit_code == 0  # wipes the old run
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    r = cli("run", job, "--no-progress", "--restart")  # sibling: must not wipe task 0's work
    assert r.exit_code == 0 and "job: 3/3 units" in r.output
    assert sorted(x["id"] for x in read_output(tmp_path / "out").to_pylist()) == list(range(12))


def test_bench_group_is_registered():
    r = cli("--help")
    assert r.exit_code == 0
    for cmd in ("run", "plan", "status", "show", "slurm", "bench"):
        assert cmd in r.output


def test_slurm_restart_script_restarts_once_even_when_resubmitted(make_job, tmp_path):
    import re
    job = make_job(demo_rows(12))
    assert cli("run", job, "--no-progress").exit_code == 0
    r = cli("slurm", job, "--array", "2", "--restart", "--gpus-per-task", "0", "--sbatch-arg=--qos=long")
    assert r.exit_code == 0
    script = (tmp_path / "job.sbatch").read_text()
    assert "--gpus" not in script and "#SBATCH --qos=long" in script
    token = re.search(r"--restart-token (\w+)", script).group(1)
    first = cli("run", job, "--no-progress", "--restart-token", token)  # the first task: wipes
    assert first.exit_code == 0 and "3 unit(s) written, 0 already done" in first.output
    again = cli("run", job, "--no-progress", "--restart-token", token)  # resubmitted: resumes
    assert again.exit_code == 0 and "all 3 of its units were committed" in again.output
    new = cli("slurm", job, "--array", "2", "--restart")  # a new script restarts once more
    token2 = re.search(r"--restart-token (\w+)", (tmp_path / "job.sbatch").read_text()).group(1)
    assert token2 != token and "--gpus" not in (tmp_path / "job.sbatch").read_text()  # device: cpu
    r = cli("run", job, "--no-progress", "--restart-token", token2)
    assert new.exit_code == 0 and r.exit_code == 0 and "3 unit(s) written, 0 already done" in r.output
    assert sorted(x["id"] for x in read_output(tmp_path / "out").to_pylist()) == list(range(12))
    assert cli("slurm", job, "--array", "2", "--sbatch-arg", "qos=long").exit_code == ExitCode.CONFIG


def test_plan_names_the_weights_and_kv_cache_formats(make_job, tmp_path):
    r = cli("plan", make_job(demo_rows(4)))
    assert "weights: the model dtype; KV cache: the model dtype" in r.output
    r = cli("plan", make_job(demo_rows(4), job_name="fp8.yaml",
                             engine={"quantization": "fp8", "kv_cache_dtype": "fp8"}))
    assert r.exit_code == 0, r.output
    assert ("weights: fp8 (fp8-on-the-fly, weights per channel, activations per token); "
            "KV cache: fp8 (e4m3)") in r.output
