"""Fixtures for the job-runner tests: a tiny model dir (char tokenizer, random Llama, two PEFT
adapters) and a job-file factory."""
from __future__ import annotations

import pytest

from runner_helpers import CHARS, SPECIALS, build_tokenizer, demo_rows, write_job, write_rows


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> dict:
    """{"model": dir, "adapters": {"reverse": dir, "upper": dir}} with random weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    adapters = {}
    for i, name in enumerate(["reverse", "upper"]):
        torch.manual_seed(i + 1)
        pm = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                             init_lora_weights=False))
        pm.save_pretrained(root / name)
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
        for key, value in over.items():
            if isinstance(value, dict) and isinstance(job.get(key), dict):
                job[key] = {**job[key], **value}
            elif value is None:
                job.pop(key, None)
            else:
                job[key] = value
        return write_job(tmp_path / job_name, job)

    return make


