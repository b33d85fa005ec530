"""Fixtures for the API tests: the demo model as an LLM, and a tiny random char-tokenizer Llama
with a chat template whose sampled tokens depend on the seed (for job-parity tests)."""
from __future__ import annotations

from pathlib import Path

import pytest


from tests.helpers.tokenizer import CHARS, SPECIALS, build_tokenizer

DEMO = Path(__file__).resolve().parent.parent.parent / "demo"


@pytest.fixture(scope="session")
def demo_llm():
    import batchrun
    return batchrun.LLM(DEMO / "model", adapters={"upper": str(DEMO / "adapters" / "upper")},
                        device="cpu", max_model_len=128)


@pytest.fixture(scope="session")
def char_model(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("apichar") / "model"
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


@pytest.fixture(scope="session")
def char_llm(char_model):
    import batchrun
    return batchrun.LLM(char_model, device="cpu", max_model_len=128, max_num_seqs=8)
