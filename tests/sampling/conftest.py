"""Fixtures for the sampling tests: a tiny char-tokenizer Llama (random, scaled weights so greedy
choices are clear) and a job-file factory. Reuses the runner tests' helpers."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "runner"))

from runner_helpers import CHARS, SPECIALS, build_tokenizer, write_job, write_rows  # noqa: E402


@pytest.fixture(scope="session")
def char_model(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("charllama") / "model"
    cfg = LlamaConfig(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(d)
    build_tokenizer().save_pretrained(d)
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
