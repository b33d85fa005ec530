"""`batchrun plan` on N rows (default 1M): the issue-11 workload (4 Parquet files, 50 % adapter
rows over 4 adapters, token counts on), on the demo model. Writes the data and job once under
DIR, then times `batchrun plan` in a fresh process with /usr/bin/time -v (wall, peak RSS).

    PYTHONPATH=. python benchmarks/plan_scale.py /tmp/plan1m [--rows 1000000] [--repeat 3] [--code A --code B]
        [--estimate-tokens]

``--later-worker`` instead times what every worker after the first pays at start-up (issue 14):
the first worker plans the output directory (in this process), every unit gets a commit marker
and a stand-in part file, then a fresh process, as a joining worker, runs ``prepare`` (checks,
input stats, fingerprint, stored plan) and the commit scan ``TaskRunner`` does, and times one
claims pass over ``--in-flight`` units held by other (live) workers: what an idle worker repeats
every poll in the tail. One JSON line per repeat.

    PYTHONPATH=. python benchmarks/plan_scale.py /tmp/plan10m --rows 10000000 --later-worker [--in-flight 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]


def write_inputs(root: Path, rows: int, rows_per_unit: int = 4096) -> Path:
    data = root / "data"
    job = root / ("job.yaml" if rows_per_unit == 4096 else f"job-{rows_per_unit}.yaml")
    if (root / f".rows-{rows}").exists():
        write_job(root, job, rows_per_unit)
        return job
    data.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    names = np.array([None, "a0", "a1", "a2", "a3"], dtype=object)
    per = rows // 4
    for k in range(4):
        ids = np.arange(per, dtype=np.int64) + k * per
        pick = rng.choice(5, size=per, p=[0.5, 0.125, 0.125, 0.125, 0.125])
        prompts = np.char.add("copy this: ", ids.astype(str)).astype(object)
        pq.write_table(pa.table({"id": ids, "prompt": pa.array(prompts, pa.string()),
                                 "adapter": pa.array(names[pick], pa.string())}),
                       data / f"part{k}.parquet", row_group_size=65536)
    write_job(root, job, rows_per_unit)
    (root / f".rows-{rows}").write_text("")
    return job


def write_job(root: Path, job: Path, rows_per_unit: int) -> None:
    demo = REPO / "demo"
    adapters = {f"a{i}": str(demo / "adapters" / ("reverse" if i % 2 == 0 else "upper")) for i in range(4)}
    out = root / ("out" if rows_per_unit == 4096 else f"out-{rows_per_unit}")  # one job per output dir
    job.write_text(
        f"model: {demo / 'model'}\nadapters:\n" + "".join(f"  {k}: {v}\n" for k, v in adapters.items())
        + f"input:\n  path: {root / 'data'}\n  id_column: id\n  prompt_column: prompt\n  adapter_column: adapter\n"
        f"  rows_per_unit: {rows_per_unit}\noutput:\n  path: {out}\nsampling:\n  max_tokens: 32\n"
        "engine:\n  device: cpu\n  max_model_len: 128\n  max_loras: 2\n")


def time_plan(job: Path, code: Path = REPO, flags: tuple = ()) -> tuple[float, int, str]:
    env = {**os.environ, "PYTHONPATH": str(code)}
    r = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "batchrun", "plan", str(job), *flags],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", r.stderr)
    h = 0
    m, s = int(wall.group(2)), float(wall.group(3))
    if wall.group(1):
        h, m = int(wall.group(1)), int(wall.group(2))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return h * 3600 + m * 60 + s, rss, r.stdout


def first_worker(job: Path) -> dict:
    """Plan the output directory as the first worker does, then commit every unit (a marker and
    one small stand-in part file each, so check_part accepts them) unless already done."""
    import pyarrow as pa
    from batchrun.job.store import commit
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.plan.prepare import prepare
    t0 = time.perf_counter()
    prep = prepare(load_job(str(job)), log=lambda m: None)
    planned = time.perf_counter() - t0
    out, units = prep.out, prep.plan.units
    os.makedirs(out.commits, exist_ok=True)
    os.makedirs(out.tmp("bench"), exist_ok=True)
    t0 = time.perf_counter()
    for u in units:
        if os.path.exists(out.commit_marker(u.index)):
            continue
        w = commit.write_part(out, "bench", u.index, pa.table({"id": [u.index]}))
        commit.publish_part(out, u.index, w.tmp)
        commit.record_commit(out, u.index, {"rows": u.rows, "error_rows": 0, "prompt_tokens": 0,
                                            "output_tokens": 0, **commit.part_record(out, u.index, w, prep.fingerprint)})
    return {"units": len(units), "first_worker_prepare_s": planned, "commit_stand_ins_s": time.perf_counter() - t0}


def later_worker(job: Path, in_flight: int) -> dict:
    """A joining worker's start-up, phase by phase (run in a fresh process: cold imports)."""
    t0 = time.perf_counter()
    from batchrun.job.store.claims import UnitClaims
    from batchrun.job.store.commit import check_part, read_commits
    from batchrun.job.jobfile.spec import load_job
    from batchrun.job.store.layout import OutputDir
    from batchrun.job.plan.units import Plan
    from batchrun.job.plan.prepare import prepare, validate
    r = {"imports_s": time.perf_counter() - t0}
    spec = load_job(str(job))
    t = time.perf_counter()
    validate(spec, for_run=True)  # inputs, schemas, model/adapter headers, tokenizer
    r["validate_s"] = time.perf_counter() - t
    t = time.perf_counter()
    prep = prepare(spec, log=lambda m: None)  # validate again (tokenizer cached) + input stats,
    r["prepare_s"] = time.perf_counter() - t  # fingerprint, manifest, the stored plan
    t = time.perf_counter()
    Plan.load(prep.out.plan_dir)
    r["plan_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    commits = read_commits(prep.out)
    r["read_markers_s"] = time.perf_counter() - t
    t = time.perf_counter()
    ok = sum(check_part(prep.out, u.index, commits.valid[u.index], prep.fingerprint) is None
             for u in prep.plan.units if u.index in commits.valid)
    r["check_parts_s"] = time.perf_counter() - t
    r["units"], r["committed_ok"] = len(prep.plan.units), ok
    # The tail: every other unit committed (known to this worker), `in_flight` held by live workers.
    units = prep.plan.units
    busy = {u.index for u in units[:in_flight]}
    scratch = OutputDir(str(Path(prep.out.path).parent / "claims-bench"))
    os.makedirs(scratch.claims, exist_ok=True)
    for i in busy:
        with open(scratch.claim(i), "w") as f:
            json.dump({"worker": "other", "token": "0" * 16, "lease_s": 3600}, f)
    claims = UnitClaims(scratch, units, "bench", done=[u.index for u in units if u.index not in busy], poll_s=0.0)
    t = time.perf_counter()
    first = next(iter(claims))  # None: one pass found every remaining unit busy
    r["claims_pass_s"], r["in_flight"] = time.perf_counter() - t, len(busy)
    assert first is None
    claims.close()
    r["total_s"] = time.perf_counter() - t0
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--code", action="append", type=Path,
                    help="a checkout to time (repeatable: A/B runs alternate); default this one")
    ap.add_argument("--later-worker", action="store_true", help="time a joining worker's start-up (above)")
    ap.add_argument("--in-flight", type=int, default=1000, help="--later-worker: units held by other workers")
    ap.add_argument("--rows-per-unit", type=int, default=4096)
    ap.add_argument("--phase", choices=["later"], help=argparse.SUPPRESS)  # the fresh process's part
    ap.add_argument("--estimate-tokens", action="store_true", help="time `plan --estimate-tokens`")
    a = ap.parse_args()
    job = write_inputs(Path(a.dir), a.rows, a.rows_per_unit)
    if a.phase == "later":
        print(json.dumps(later_worker(job, a.in_flight)))
        return
    if a.later_worker:
        print(json.dumps(first_worker(job)))
        for _ in range(a.repeat):
            r = subprocess.run([sys.executable, __file__, a.dir, "--rows", str(a.rows), "--phase", "later",
                                "--in-flight", str(a.in_flight), "--rows-per-unit", str(a.rows_per_unit)], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
            if r.returncode != 0:
                raise SystemExit(r.stderr)
            print(r.stdout.strip())
        return
    for i in range(a.repeat):
        for code in a.code or [REPO]:
            secs, rss, out = time_plan(job, code, ("--estimate-tokens",) if a.estimate_tokens else ())
            if i == 0:
                print(out)
            print(f"run {i} {code}: {secs:.2f} s wall, peak RSS {rss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
