"""`batchrun status` shows each worker's progress (units done, units claimed now, rows, rows/s)
from _batchrun/progress/<worker>.json and the claim files, while the workers run and after."""
import json
import os
import time

import batchrun.job.run.progress_files as wp
from batchrun.job.run.progress_files import read_progress
from batchrun.job.jobfile.spec import load_job
from batchrun.job.store.layout import OutputDir
from batchrun.job.report import status_report
from batchrun.job.run.runner import run_job
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.faults import wait_for
from tests.helpers.jobs import demo_rows, run_cli


def workers_of(status_text: str) -> dict[str, list[str]]:
    """worker -> its cells, from the status table under the 'worker state ...' header."""
    lines = status_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["worker", "state"])
    rows = {}
    for ln in lines[start + 1:]:
        if not ln.strip():
            break
        cells = ln.split()
        rows[cells[0]] = cells[1:]
    return rows


def test_a_finished_worker_shows_its_counts(make_job, tmp_path):
    job = make_job(demo_rows(30))
    run_job(load_job(job), engine_factory=FakeEngine.from_spec, progress=False, log=lambda m: None, worker="w0")
    text, _ = status_report(str(tmp_path / "out"))
    state, host, done, claimed, rows, rate, _tok, *_ = workers_of(text)["w0"]
    assert (state, done, claimed, rows) == ("done", "9", "0", "30") and float(rate) > 0, text


def test_a_running_worker_shows_units_done_and_claimed_now(make_job, tmp_path, monkeypatch):
    monkeypatch.setattr(wp, "WRITE_EVERY_S", 0.0)  # every commit rewrites the file
    seen = []

    class Watched(FakeEngine):
        def generate(self, requests, on_result=None):
            if requests[0].adapter and not seen:  # the base shard ran, a LoRA unit is claimed, not yet run
                out = OutputDir(str(tmp_path / "out"))
                wait_for(lambda: any(p.get("units_done") for p in read_progress(out)))  # the writer thread committed
                r = run_cli("status", tmp_path / "out")
                seen.append(r.stdout + r.stderr)
            return super().generate(requests, on_result)

    job = make_job(demo_rows(30))
    run_job(load_job(job), engine_factory=Watched, progress=False, log=lambda m: None, worker="w1")
    state, host, done, claimed, rows, *_ = workers_of(seen[0])["w1"]
    assert state == "running" and int(done) >= 1 and int(claimed) >= 1 and int(rows) >= 4, seen[0]
    assert int(done) < 9  # a snapshot from mid-run, not the end


def test_a_dead_worker_and_a_starting_one(tmp_path):
    out = OutputDir(str(tmp_path))
    os.makedirs(wp.progress_dir(out))
    os.makedirs(out.claims)
    with open(os.path.join(wp.progress_dir(out), "3-j7.json"), "w") as f:  # said running, lock free: killed
        json.dump({"worker": "3-j7", "status": "running", "host": "n1", "units_done": 4, "output_rows": 40,
                   "output_rows_per_s": 2.5, "output_tok_per_s": 90, "updated": time.time() - 30}, f)
    for unit, owner in ((5, "3-j7"), (6, "0-j9"), (7, "0-j9")):
        with open(out.claim(unit), "w") as f:
            json.dump({"worker": owner, "token": "t"}, f)
    rows = {r[0]: r[1:] for r in wp.worker_rows(out, now=time.time())}
    assert rows["3-j7"][:6] == ["died", "n1", 4, 1, 40, "2.5"] and rows["3-j7"][-1] in ("30s ago", "31s ago")
    assert rows["0-j9"][:4] == ["starting", "?", 0, 2]
