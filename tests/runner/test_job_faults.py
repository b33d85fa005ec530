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
from batchrun.job.jobfile.spec import load_job, parse_job

REPO = Path(__file__).resolve().parent.parent.parent
HEAD = "model: m\ninput: {path: x}\noutput: {path: o}\n"
MAX_MSG = 500


def bomb_yaml(levels: int = 9, width: int = 9) -> str:
    """A few hundred bytes that expand to width**levels values: each anchor lists the previous
    one ``width`` times. Hung under ``model`` so parse_job would quote it in its message."""
    lines = ["model:", "  - &a0 [" + ",".join(["x"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"  - &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\ninput: {path: x}\noutput: {path: o}\n"


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


# ---- YAML aliases ---------------------------------------------------------------------------

def test_alias_bomb_refused_before_construction(tmp_path):
    text = bomb_yaml()
    assert len(text) < 500  # ~387 million values once expanded
    t0 = time.perf_counter()
    msg = load_err(tmp_path, text)
    assert time.perf_counter() - t0 < 5
    assert "job file expands to more than 100000 values (YAML aliases/anchors?)" in msg
    assert len(msg) < MAX_MSG


def test_alias_bomb_under_memory_limit(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text(bomb_yaml())
    r = in_small_process(f"""
        from batchrun.errors import ConfigError
        from batchrun.job.jobfile.spec import load_job
        try:
            load_job({str(f)!r})
        except ConfigError as e:
            print("CONFIGERROR", len(str(e)), str(e))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CONFIGERROR" in r.stdout and "expands to more than" in r.stdout


def test_shared_python_structure_is_shown_bounded():
    # parse_job gets already-built data too: a 9-level shared list must not be repr'd in full.
    r = in_small_process("""
        from batchrun.errors import ConfigError
        from batchrun.job.jobfile.spec import parse_job
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


def test_moderately_aliased_job_still_loads(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text(
        "model: m\n"
        "adapters: {a: &ad /ads/a, b: *ad, c: *ad}\n"
        "input: {path: data/in.parquet, adapter_column: &col adapter, id_column: *col}\n"
        "output: {path: out}\n"
        "sampling: &smp {max_tokens: 8, temperature: 0.5}\n"
        "engine: {<<: {max_num_seqs: 8, max_loras: 3}, max_lora_rank: 8}\n"
    )
    spec = load_job(f)
    assert spec.adapters == {"a": "/ads/a", "b": "/ads/a", "c": "/ads/a"}
    assert spec.input.path == str(tmp_path / "data" / "in.parquet")
    assert spec.input.adapter_column == spec.input.id_column == "adapter"
    assert spec.sampling.max_tokens == 8 and spec.sampling.temperature == 0.5
    assert spec.engine.max_num_seqs == 8 and spec.engine.max_loras == 3 and spec.engine.max_lora_rank == 8


def test_aliases_just_under_the_limit_load(tmp_path):
    # 10 x 10 x 10 x 10 = 10_000 leaves (< the 100_000 limit): built, then the ordinary type error.
    lines = ["  - &l0 [" + ",".join(["x"] * 10) + "]"]
    for i in range(1, 4):
        lines.append(f"  - &l{i} [" + ",".join([f"*l{i - 1}"] * 10) + "]")
    f = tmp_path / "job.yaml"
    f.write_text("model:\n" + "\n".join(lines) + "\ninput: {path: x}\noutput: {path: o}\n")
    with pytest.raises(ConfigError) as e:
        load_job(f)
    msg = str(e.value)
    assert "model: expected a string, got [[" in msg and "expands" not in msg
    assert len(msg) < MAX_MSG


@pytest.mark.parametrize("text", [
    "model: &a [*a]\ninput: {path: x}\noutput: {path: o}\n",
    "&top {model: m, input: {path: x}, output: {path: o}, sampling: *top}\n",
    "model: m\ninput: &i {path: x, id_column: [1, {deeper: *i}]}\noutput: {path: o}\n",
])
def test_recursive_alias_is_a_clean_error(tmp_path, text):
    msg = load_err(tmp_path, text)
    assert "recursive YAML alias" in msg and len(msg) < MAX_MSG


def test_deep_nesting_is_a_clean_error(tmp_path):
    msg = load_err(tmp_path, "model: " + "[" * 2000 + "]" * 2000 + "\n" + HEAD[len("model: m\n"):])
    assert "nests too deeply" in msg and len(msg) < MAX_MSG


def test_empty_and_non_mapping_documents_keep_their_messages(tmp_path):
    assert load_err(tmp_path, "") == "model: required field is missing (expected a string)"
    assert load_err(tmp_path, "- 1\n- 2\n") == "job file: expected a mapping, got [1, 2] (list)"
    assert "not valid YAML" in load_err(tmp_path, "model: [unclosed\n")


# ---- NaN / inf ------------------------------------------------------------------------------

@pytest.mark.parametrize("section, key, value", [
    ("sampling", "temperature", ".nan"),
    ("sampling", "temperature", ".inf"),
    ("sampling", "temperature", "-.inf"),
    ("sampling", "top_p", ".nan"),
    ("sampling", "top_p", ".inf"),
    ("sampling", "top_p", "-.inf"),
    ("engine", "gpu_memory_utilization", ".nan"),
    ("engine", "gpu_memory_utilization", ".inf"),
    ("engine", "gpu_memory_utilization", "-.inf"),
    ("sampling", "temperature", "9" * 400),  # an integer too large for a float
])
def test_non_finite_numbers_refused(tmp_path, section, key, value):
    msg = load_err(tmp_path, HEAD + f"{section}: {{{key}: {value}}}\n")
    assert msg.startswith(f"{section}.{key}: must be a finite number, got ")
    assert len(msg) < MAX_MSG


# ---- environment variables in paths ---------------------------------------------------------

@pytest.mark.parametrize("field, ref", [
    ("output.path", "$SCRATCH_UNSET_XYZ"),
    ("output.path", "${SCRATCH_UNSET_XYZ}"),
    ("input.path", "$SCRATCH_UNSET_XYZ"),
    ("input.path", "${SCRATCH_UNSET_XYZ}"),
    ("model", "$SCRATCH_UNSET_XYZ"),
    ("adapters.rev", "${SCRATCH_UNSET_XYZ}"),
])
def test_unset_env_var_in_path_refused(monkeypatch, field, ref):
    monkeypatch.delenv("SCRATCH_UNSET_XYZ", raising=False)
    value = f"{ref}/part"
    raw = {"model": "m", "input": {"path": "in.parquet", "adapter_column": "a"}, "output": {"path": "out"}}
    if field == "model":
        raw["model"] = value
    elif field == "adapters.rev":
        raw["adapters"] = {"rev": value}
    else:
        raw[field.split(".")[0]]["path"] = value
    with pytest.raises(ConfigError) as e:
        parse_job(raw, base_dir="/jobs")
    assert str(e.value) == (f"{field}: environment variable {ref} is not set (in {value!r}); "
                            "set it or write the path out")


def test_unset_env_var_named_even_after_a_set_one(monkeypatch, tmp_path):
    monkeypatch.setenv("SCRATCH_SET_XYZ", "/scratch/me")
    monkeypatch.delenv("SCRATCH_UNSET_XYZ", raising=False)
    msg = load_err(tmp_path, "model: m\ninput: {path: x}\noutput: {path: $SCRATCH_SET_XYZ/$SCRATCH_UNSET_XYZ}\n")
    assert msg.startswith("output.path: environment variable $SCRATCH_UNSET_XYZ is not set")


def test_set_env_vars_still_expand(monkeypatch, tmp_path):
    monkeypatch.setenv("SCRATCH_SET_XYZ", "/scratch/me")
    f = tmp_path / "job.yaml"
    f.write_text("model: ${SCRATCH_SET_XYZ}/m\ninput: {path: $SCRATCH_SET_XYZ/in}\n"
                 "output: {path: '${SCRATCH_SET_XYZ}/out'}\n")
    spec = load_job(f)
    assert spec.model == "/scratch/me/m"
    assert spec.input.path == "/scratch/me/in"
    assert spec.output.path == "/scratch/me/out"


# ---- huge values ----------------------------------------------------------------------------

BIG = "a" * 10_000_000


@pytest.mark.parametrize("raw, needle", [
    ({"engine": {"device": BIG}}, "engine.device: expected one of auto, cpu, cuda, got 'aaa"),
    ({"engine": {"dtype": BIG}}, "engine.dtype: expected one of"),
    ({"on_error": BIG}, "on_error: expected skip"),
    ({BIG: 1}, ": unknown field (allowed under the top level:"),
    ({"engine": {BIG: 1}}, ": unknown field (allowed under engine:"),
    ({"adapters": {BIG: 5}, "input": {"path": "x", "adapter_column": "a"}}, ": expected a string (the PEFT"),
    ({"output": {"path": "$" + BIG}}, "output.path: environment variable $aaa"),
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
