"""Hostile or broken job files: YAML alias bombs, recursive aliases, NaN/inf numbers, unset
environment variables and huge values must each give a short ConfigError, never a MemoryError,
RecursionError or a job writing into a folder literally named "$SCRATCH"."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from batchrun.errors import ConfigError
from batchrun.job import load_job, parse_job

REPO = Path(__file__).resolve().parent.parent.parent
HEAD = "model: m\ninput: {path: x}\noutput: {path: o}\n"
MAX_MSG = 500


def load_err(tmp_path, text: str) -> str:
    f = tmp_path / "job.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_job(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: ")
    return msg[len(f"{f}: "):]


def in_small_process(code: str, limit_gb: int = 2, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose address space is capped, so a regression shows up
    as a MemoryError there instead of exhausting this machine."""
    prelude = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, ({limit_gb} << 30, {limit_gb} << 30))
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---- shared structures -----------------------------------------------------------------------

def test_shared_python_structure_is_shown_bounded():
    # parse_job gets already-built data too: a 9-level shared list must not be repr'd in full.
    r = in_small_process("""
        from batchrun.errors import ConfigError
        from batchrun.job import parse_job
        value = ["x"] * 9
        for _ in range(8):
            value = [value] * 9
        raw = {"model": value, "input": {"path": "x"}, "output": {"path": "o"}}
        try:
            parse_job(raw, base_dir="/jobs")
        except ConfigError as e:
            print("CONFIGERROR", len(str(e)), str(e))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stdout.strip()
    assert line.startswith("CONFIGERROR") and "model: expected a string, got [[[" in line
    assert int(line.split()[1]) < MAX_MSG


# ---- huge values ----------------------------------------------------------------------------

BIG = "a" * 10_000_000


@pytest.mark.parametrize("raw, needle", [
    ({"engine": {"device": BIG}}, "engine.device: expected one of auto, cpu, cuda, got 'aaa"),
    ({"engine": {"dtype": BIG}}, "engine.dtype: expected one of"),
    ({"on_error": BIG}, "on_error: expected skip"),
    ({BIG: 1}, ": unknown field (allowed under the top level:"),
    ({"engine": {BIG: 1}}, ": unknown field (allowed under engine:"),
    ({"adapters": {BIG: 5}, "input": {"path": "x", "adapter_column": "a"}}, ": expected a string (the PEFT"),
])
def test_huge_values_give_short_messages(raw, needle):
    base = {"model": "m", "input": {"path": "x"}, "output": {"path": "o"}}
    base.update(raw)
    with pytest.raises(ConfigError) as e:
        parse_job(base, base_dir="/jobs")
    msg = str(e.value)
    assert needle in msg
    assert len(msg) < MAX_MSG


def test_huge_string_in_yaml_file_gives_short_message(tmp_path):
    msg = load_err(tmp_path, HEAD + "engine: {device: " + "a" * 1_000_000 + "}\n")
    assert msg.startswith("engine.device: expected one of auto, cpu, cuda, got 'aaa")
    assert len(msg) < MAX_MSG
