"""`batchrun plan` and `batchrun run` of one input on a local S3 server vs the same files on local
disk: wall time and peak RSS of each command (its own process, os.wait4).

CPU only: `plan` and `verify` are the real CLI; `run`'s engine is the test double
(tests/helpers/fake_engine.py: the demo's string transforms, no model math, 256 rows a step) on
the tiny char-tokenizer model of the tests, so the figures measure
what differs between the two runs: listing, reading, pinning, planning, claiming, committing.
The S3 server is moto's (the `test` extra), in its own process on localhost.

    PYTHONPATH=. python benchmarks/s3_io.py --rows 1000000 --out benchmarks/results/s3-io.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# `batchrun run` with the test double as its engine, finishing 256 rows a step (the double's
# default of 3 would make the engine, not the storage, the whole measurement)
FAKE_RUN = [sys.executable, "-c", "import sys; from tests.helpers.fake_engine import FakeEngine; "
            "FakeEngine.batch = 256; from tests.helpers.fake_cli import cli; cli(sys.argv[1:])"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured(cmd: list[str], env: dict) -> dict:
    """Run ``cmd`` under /usr/bin/time (a small parent: the peak RSS is the command's own, not
    this process's forked image); its wall time and peak RSS (MiB)."""
    proc = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M"] + cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    wall, rss_kib = proc.stderr.strip().splitlines()[-1].split()[1:]
    return {"wall_s": float(wall), "peak_rss_mib": round(int(rss_kib) / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rows-per-unit", type=int, default=4096)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import boto3
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml
    from tests.helpers.models import save_hf_model
    from tests.helpers.tokenizer import build_tokenizer

    work = Path(tempfile.mkdtemp(prefix="batchrun-s3-io-"))
    save_hf_model("char_llama", work / "model", tokenizer=build_tokenizer())
    words = ["hello", "world", "batch", "run", "lora", "fox", "abc", "xyz", "tiny", "model"]
    n, files = args.rows, 4
    for f in range(files):
        lo, hi = n * f // files, n * (f + 1) // files
        ids = pa.array(range(lo, hi), pa.int64())
        prompts = pa.array([f"{words[i % 10]} {words[(i * 7 + 3) % 10]}" for i in range(lo, hi)])
        (work / "in").mkdir(exist_ok=True)
        pq.write_table(pa.table({"id": ids, "prompt": prompts}), work / "in" / f"part-{f}.parquet",
                       row_group_size=65536)

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                          region_name="us-east-1")
        s3.create_bucket(Bucket="bench")
        for p in sorted((work / "in").iterdir()):
            s3.upload_file(str(p), "bench", f"in/{p.name}")
        results = {}
        for kind, inp, out in (("local", str(work / "in"), str(work / "out")),
                               ("s3", "s3://bench/in/", "s3://bench/runs/out")):
            job = work / f"{kind}.yaml"
            job.write_text(yaml.safe_dump({
                "model": str(work / "model"),
                "input": {"path": inp, "id_column": "id", "prompt_column": "prompt",
                          "rows_per_unit": args.rows_per_unit},
                "output": {"path": out}, "sampling": {"max_tokens": 8},
                "engine": {"device": "cpu", "max_model_len": 128, "max_num_seqs": 64}}))
            real = [sys.executable, "-m", "batchrun"]
            results[kind] = {
                "plan": measured(real + ["plan", str(job), "--no-tokens"], env),
                "run": measured(FAKE_RUN + ["run", str(job), "--progress", "none"], env),
                "verify": measured(real + ["verify", out], env),
            }
            print(kind, json.dumps(results[kind]), flush=True)
    finally:
        server.terminate()
        server.wait(30)
    record = {"command": "PYTHONPATH=. python benchmarks/s3_io.py " + " ".join(sys.argv[1:]),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=REPO).stdout.strip(),
              "machine": f"CPU only, {os.cpu_count()} cores (shared), moto server on localhost",
              "engine": "tests/helpers/fake_engine.py (no model math), tiny char-tokenizer model",
              "rows": n, "files": files, "rows_per_unit": args.rows_per_unit, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
