"""Plan cost at scale (docs/scaling.md): make_plan over N rows (id + adapter columns), store it,
and load it back the way a later worker does. Usage:
    PYTHONPATH=. /usr/bin/time -v python scripts/bench_plan_10m.py [--rows 10000000] [--dir /tmp/plan-bench]
"""
import argparse
import json
import os
import resource
import shutil
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchrun.job.jobfile.spec import parse_job
from batchrun.job.plan.units import Plan, make_plan

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, default=10_000_000)
ap.add_argument("--files", type=int, default=10)
ap.add_argument("--dir", default="/tmp/plan-bench")
a = ap.parse_args()
shutil.rmtree(a.dir, ignore_errors=True)
os.makedirs(os.path.join(a.dir, "data"))
per = a.rows // a.files
rng = np.random.default_rng(0)
names = np.array([None, None, None, "reverse", "upper"], dtype=object)
for i in range(a.files):
    ids = np.arange(i * per, (i + 1) * per, dtype=np.int64)
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(["hello world"] * per),
                             "adapter": pa.array(names[rng.integers(0, 5, per)], pa.string())}),
                   os.path.join(a.dir, "data", f"part-{i:03d}.parquet"))
spec = parse_job({"model": "m", "adapters": {"reverse": "r", "upper": "u"},
                  "input": {"path": os.path.join(a.dir, "data"), "id_column": "id",
                            "adapter_column": "adapter", "rows_per_unit": 1024},
                  "output": {"path": os.path.join(a.dir, "out")}}, os.path.join(a.dir, "job.yaml"))
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
plan = make_plan(spec)
t_plan = time.perf_counter() - t0
os.makedirs(os.path.join(a.dir, "out"))
t1 = time.perf_counter()
plan.save(os.path.join(a.dir, "out", "plan"))
t_save = time.perf_counter() - t1
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t2 = time.perf_counter()
loaded = Plan.load(os.path.join(a.dir, "out", "plan"))
t_load = time.perf_counter() - t2
size = sum(os.path.getsize(os.path.join(a.dir, "out", "plan", f)) for f in os.listdir(os.path.join(a.dir, "out", "plan")))
print(json.dumps({"rows": plan.total_rows, "units": len(plan.units), "plan_s": round(t_plan, 2),
                  "save_s": round(t_save, 2), "load_s": round(t_load, 3), "plan_bytes": size,
                  "peak_rss_mb_before_plan": rss0 // 1024, "peak_rss_mb_after_plan": rss1 // 1024}))
shutil.rmtree(a.dir, ignore_errors=True)
