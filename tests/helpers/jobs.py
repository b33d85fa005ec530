"""Job files, input rows, outputs, and running the CLI (real or with the fake engine) for the
job-side tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FAKE_CLI = HERE / "fake_cli.py"


def write_rows(path: Path, rows: list[dict], schema: pa.Schema | None = None, row_group_size: int | None = None):
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def demo_rows(n: int, adapters=("reverse", "upper"), start: int = 0) -> list[dict]:
    """Rows with lowercase word prompts; every third row base, then reverse, then upper."""
    words = ["hello", "world", "batch", "run", "lora", "fox", "abc", "xyz", "tiny", "model"]
    rows = []
    for i in range(start, start + n):
        prompt = f"{words[i % len(words)]} {words[(i * 7 + 3) % len(words)]}"
        kind = i % 3
        rows.append({"id": i, "prompt": prompt, "adapter": None if kind == 0 else adapters[kind - 1]})
    return rows


def write_job(path: Path, job: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_cli(*args, env: dict | None = None, fake: bool = True, timeout: float = 120, cwd=None):
    """Run the CLI in a subprocess; fake=True swaps in the FakeEngine (tests/helpers/fake_cli.py)."""
    cmd = [sys.executable, str(FAKE_CLI)] if fake else [sys.executable, "-m", "batchrun"]
    full_env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                **(env or {})}
    return subprocess.run(cmd + [str(a) for a in args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=cwd)


def read_output(out: Path) -> pa.Table:
    import pyarrow.dataset as ds
    return ds.dataset(str(out), format="parquet").to_table()


def expected(prompt: str, adapter: str | None) -> str:
    return {None: prompt, "reverse": prompt[::-1], "upper": prompt.upper()}[adapter]


def load_json(path: Path):
    return json.loads(Path(path).read_text())


def fork_cli(args: list, crash_at: str = "", env: dict | None = None):
    """Start the (fake-engine) CLI in a forked child: everything is already imported, so it
    starts in milliseconds. Returns the multiprocessing.Process (exitcode = the CLI's exit code)."""
    import multiprocessing
    from tests.helpers.fake_cli import cli
    env = {"TOKENIZERS_PARALLELISM": "false", **(env or {})}  # the Rust pool does not survive fork
    proc = multiprocessing.get_context("fork").Process(target=cli, args=([str(a) for a in args], crash_at, env))
    proc.start()
    return proc


# the CLI in a fresh interpreter where importing the named top-level packages raises ImportError
_BLOCKER = ("import sys\n"
            "BLOCKED = tuple(sys.argv[1].split(','))\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in BLOCKED:\n"
            "            raise ImportError(f'{name} is blocked in this test')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from batchrun.__main__ import entry\n"
            "entry(sys.argv[2:])\n")


def run_cli_without(blocked: tuple[str, ...], *args, timeout: float = 180):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", _BLOCKER, ",".join(blocked), *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)
