"""Claim overhead on this machine: claim + still_mine + release per unit (one worker), and a
full pass over N already-committed units (what a late worker pays). Usage:
    PYTHONPATH=. python scripts/bench_claims.py [--units 10000] [--dir /tmp/claims-bench]
"""
import argparse
import json
import os
import shutil
import time

from batchrun.job.store.claims import UnitClaims
from batchrun.job.store.layout import OutputDir
from batchrun.job.plan.units import Unit

ap = argparse.ArgumentParser()
ap.add_argument("--units", type=int, default=10000)
ap.add_argument("--dir", default="/tmp/claims-bench")
a = ap.parse_args()
shutil.rmtree(a.dir, ignore_errors=True)
out = OutputDir(a.dir)
os.makedirs(out.commits)
units = [Unit(i, None, True, i * 1024, 1024) for i in range(a.units)]
c = UnitClaims(out, units, "0", lease_s=120)
t0 = time.perf_counter()
n = 0
for u in c:
    assert c.still_mine(u.index)
    with open(out.commit_marker(u.index), "w") as f:  # stands in for the commit marker
        json.dump({"unit": u.index, "rows": 1024}, f)
    c.release(u.index)
    n += 1
dt = time.perf_counter() - t0
c.close()
late = UnitClaims(out, units, "1", lease_s=120)
t1 = time.perf_counter()
assert list(late) == []
scan = time.perf_counter() - t1
print(json.dumps({"units": n, "claim_roundtrip_us": round(dt / n * 1e6, 1),
                  "late_worker_scan_s": round(scan, 3), "scan_per_unit_us": round(scan / n * 1e6, 1)}))
shutil.rmtree(a.dir, ignore_errors=True)
