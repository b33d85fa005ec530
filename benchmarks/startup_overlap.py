"""`batchrun run`'s start-up up to the engine load, with and without the preload thread
(batchrun/job/preload.py): job file, checks, digests, fingerprint and plan (``prepare``), then the
engine imports and the job's tokenizer, each mode in a fresh interpreter (imports are cached per
process). Prints process start -> engine modules imported, per mode and repeat.

    PYTHONPATH=. python benchmarks/startup_overlap.py JOB [--repeat 3]

Writes the job's output directory's plan and manifest (``--restart`` semantics: it restarts it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
from batchrun.job import preload
preload.start()
from batchrun.job.spec import load_job
from batchrun.job.prepare import prepare
from batchrun.job.token_count import load_tokenizer
spec = load_job(sys.argv[1])
preload.then(lambda: load_tokenizer(spec.model))
t1 = time.perf_counter()
prepare(spec, restart=True)
t2 = time.perf_counter()
preload.wait()
import batchrun.engine.engine, batchrun.engine.models.loader  # what runner.load_engine needs
t3 = time.perf_counter()
print(json.dumps({"job_s": t1 - t0, "prepare_s": t2 - t1, "after_prepare_s": t3 - t2, "total_s": t3 - t0,
                  "waited_s": preload.waited_s}))
"""


def run_once(job: str, preload: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "BATCHRUN_PRELOAD": "1" if preload else "0"}
    r = subprocess.run([sys.executable, "-c", CHILD, job], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("job")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    for i in range(a.repeat):
        for mode in (True, False):
            t = run_once(a.job, mode)
            print(f"run {i} preload={'on ' if mode else 'off'}: {t['total_s']:.2f} s to the engine imports "
                  f"(job file {t['job_s']:.2f}, prepare {t['prepare_s']:.2f} (waited {t['waited_s']:.2f}), "
                  f"then {t['after_prepare_s']:.2f})")


if __name__ == "__main__":
    main()
