"""End to end through the real engine.

- The demo job (jobs/demo.yaml: trained tiny Llama + `reverse`/`upper` adapters): every output is
  the expected string.
- A tiny random model: `batchrun run` in a real subprocess, SIGKILLed after its first commit,
  rerun: every id exactly once, and the rerun's outputs equal an uninterrupted run's.
"""
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchrun.job.jobfile.spec import OutputSpec, load_job
from batchrun.job.run.runner import run_job
from tests.helpers.jobs import demo_rows, read_output, REPO

DEMO_JOB = REPO / "jobs" / "demo.yaml"
HAVE_DEMO = (REPO / "demo" / "model" / "config.json").is_file() and (REPO / "demo" / "data" / "prompts.parquet").is_file()
EXPECTED = {None: lambda s: s, "reverse": lambda s: s[::-1], "upper": lambda s: s.upper()}


@pytest.mark.skipif(not HAVE_DEMO, reason="demo assets not built (python scripts/train_demo.py)")
def test_demo_job_outputs_expected_strings(tmp_path):
    import pyarrow.parquet as pq
    spec = load_job(DEMO_JOB)
    spec = dataclasses.replace(spec, output=OutputSpec(str(tmp_path / "out")))
    stats = run_job(spec, progress=False, log=lambda m: None)
    prompts = {r["id"]: r for r in pq.read_table(REPO / "demo" / "data" / "prompts.parquet").to_pylist()}
    assert stats.output_rows == len(prompts) and stats.error_rows == 0
    out = read_output(tmp_path / "out").to_pylist()
    assert sorted(r["id"] for r in out) == sorted(prompts)
    kinds = set()
    for r in out:
        p = prompts[r["id"]]
        adapter = p["adapter"] or None
        kinds.add(adapter)
        assert r["adapter"] == adapter
        assert r["output_text"] == EXPECTED[adapter](p["prompt"]), (r, p)
        assert r["finish_reason"] == "stop" and r["error"] is None
    assert kinds == {None, "reverse", "upper"}


def committed(commits: Path) -> list[str]:
    """Commit markers (not the dot-prefixed temp files they are written through)."""
    return [n for n in os.listdir(commits) if n.startswith("unit-")] if commits.is_dir() else []


def _batchrun(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "batchrun", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


@pytest.mark.slow
def test_real_engine_kill9_then_resume_matches_clean_run(make_job, tmp_path):
    rows = demo_rows(40)
    rows[5]["prompt"] = ""  # one error row along the way
    job = make_job(rows, input={"rows_per_unit": 3}, sampling={"max_tokens": 12, "temperature": 0.8, "seed": 7})
    out = tmp_path / "out"
    commits = out / "_batchrun" / "commits"
    proc = _batchrun(["run", job, "--no-progress"])
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if commits.is_dir() and len(os.listdir(commits)) >= 2:
            break
        time.sleep(0.01)
    assert proc.poll() is None, proc.stdout.read()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    done = len(committed(commits))
    assert done < 15, "run finished before the kill; nothing was tested"
    partial = read_output(out)
    assert partial.num_rows == len(set(partial.column("id").to_pylist()))
    # rerun in-process with the real engine (same per-row seeds -> same samples)
    stats = run_job(load_job(job), progress=False, log=lambda m: None)
    assert stats.units_skipped == done and stats.status == "done"
    resumed = {r["id"]: r for r in read_output(out).to_pylist()}
    assert sorted(resumed) == list(range(40))
    assert resumed[5]["finish_reason"] == "error"
    # a clean run into another directory gives the same rows (sampling is seeded per row id)
    spec = dataclasses.replace(load_job(job), output=OutputSpec(str(tmp_path / "clean")))
    run_job(spec, progress=False, log=lambda m: None)
    clean = {r["id"]: r for r in read_output(tmp_path / "clean").to_pylist()}
    for i in range(40):
        assert resumed[i]["output_token_ids"] == clean[i]["output_token_ids"], i
        assert resumed[i]["finish_reason"] in ("stop", "length", "error")
        assert resumed[i]["output_tokens"] <= 12
