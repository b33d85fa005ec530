"""Pytest fixtures shared by every folder (tests/conftest.py imports them): the job-side tests'
tiny model dir and job-file factories. Session-scoped models are built once per test process."""
from __future__ import annotations

import pytest

from tests.helpers.adapters import make_adapter
from tests.helpers.jobs import demo_rows, write_job, write_rows
from tests.helpers.models import save_hf_model
from tests.helpers.tokenizer import build_tokenizer


def _merge(job: dict, over: dict) -> dict:
    """Section overrides: a dict merges into that section, None removes it, anything else replaces it."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(job.get(key), dict):
            job[key] = {**job[key], **value}
        elif value is None:
            job.pop(key, None)
        else:
            job[key] = value
    return job


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> dict:
    """{"model": dir, "adapters": {"reverse": dir, "upper": dir}}: the char-tokenizer Llama with
    transformers' random init and two PEFT adapters (q/v, rank 4) of it."""
    root = tmp_path_factory.mktemp("tiny")
    save_hf_model("char_llama", root / "model", tokenizer=build_tokenizer())
    adapters = {}
    for i, name in enumerate(["reverse", "upper"]):
        make_adapter(root / name, "char_llama", seed=i + 1, r=4, lora_alpha=8)
        adapters[name] = str(root / name)
    return {"model": str(root / "model"), "adapters": adapters}


@pytest.fixture
def make_job(tmp_path, tiny_model):
    """make_job(rows=..., **overrides) -> job file path; input at data/in.parquet, output at out/."""

    def make(rows=None, files=None, job_name="job.yaml", **over):
        if files is None:
            write_rows(tmp_path / "data" / "in.parquet", rows if rows is not None else demo_rows(30))
        else:
            for name, rs in files.items():
                write_rows(tmp_path / "data" / name, rs)
        job = {
            "model": tiny_model["model"],
            "adapters": dict(tiny_model["adapters"]),
            "input": {"path": "data", "id_column": "id", "prompt_column": "prompt",
                      "adapter_column": "adapter", "rows_per_unit": 4},
            "output": {"path": "out"},
            "sampling": {"max_tokens": 24},
            "engine": {"device": "cpu", "max_model_len": 128, "max_num_seqs": 8},
        }
        return write_job(tmp_path / job_name, _merge(job, over))

    return make


@pytest.fixture(scope="session")
def char_model(tmp_path_factory) -> str:
    """The char-tokenizer Llama with matrices redrawn N(0, 0.3), so greedy choices are clear
    (the sampling tests compare tokens)."""
    d = tmp_path_factory.mktemp("charllama") / "model"
    save_hf_model("char_llama", d, tokenizer=build_tokenizer(), over={"init_std": 0.3})
    return str(d)


@pytest.fixture
def job_factory(tmp_path, char_model):
    """job_factory(rows, **section overrides) -> job file (input data/in.parquet, output out/)."""

    def make(rows, schema=None, model=None, job_name="job.yaml", **over):
        write_rows(tmp_path / "data" / "in.parquet", rows, schema=schema)
        job = {"model": model or char_model,
               "input": {"path": "data", "id_column": "id", "prompt_column": "prompt", "rows_per_unit": 3},
               "output": {"path": "out"},
               "sampling": {"max_tokens": 10},
               "engine": {"device": "cpu", "max_model_len": 128, "max_num_seqs": 8}}
        for key, value in over.items():
            job[key] = {**job[key], **value} if isinstance(value, dict) and isinstance(job.get(key), dict) else value
        return write_job(tmp_path / job_name, job)

    return make
