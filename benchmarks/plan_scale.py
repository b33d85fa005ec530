"""`batchrun plan` on N rows (default 1M): the issue-11 workload (4 Parquet files, 50 % adapter
rows over 4 adapters, token counts on), on the demo model. Writes the data and job once under
DIR, then times `batchrun plan` in a fresh process with /usr/bin/time -v (wall, peak RSS).

    PYTHONPATH=. python benchmarks/plan_scale.py /tmp/plan1m [--rows 1000000] [--repeat 3] [--code A --code B]
        [--estimate-tokens]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]


def write_inputs(root: Path, rows: int) -> Path:
    data = root / "data"
    job = root / "job.yaml"
    if job.exists() and (root / f".rows-{rows}").exists():
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
    demo = REPO / "demo"
    adapters = {f"a{i}": str(demo / "adapters" / ("reverse" if i % 2 == 0 else "upper")) for i in range(4)}
    job.write_text(
        f"model: {demo / 'model'}\nadapters:\n" + "".join(f"  {k}: {v}\n" for k, v in adapters.items())
        + f"input:\n  path: {data}\n  id_column: id\n  prompt_column: prompt\n  adapter_column: adapter\n"
        f"  rows_per_unit: 4096\noutput:\n  path: {root / 'out'}\nsampling:\n  max_tokens: 32\n"
        "engine:\n  device: cpu\n  max_model_len: 128\n  max_loras: 2\n")
    (root / f".rows-{rows}").write_text("")
    return job


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--code", action="append", type=Path,
                    help="a checkout to time (repeatable: A/B runs alternate); default this one")
    ap.add_argument("--estimate-tokens", action="store_true", help="time `plan --estimate-tokens`")
    a = ap.parse_args()
    job = write_inputs(Path(a.dir), a.rows)
    for i in range(a.repeat):
        for code in a.code or [REPO]:
            secs, rss, out = time_plan(job, code, ("--estimate-tokens",) if a.estimate_tokens else ())
            if i == 0:
                print(out)
            print(f"run {i} {code}: {secs:.2f} s wall, peak RSS {rss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
