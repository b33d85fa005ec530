"""Piecewise prefill graphs on the GPU (engine/prefill_graphs.py): an engine that replays them
gives the greedy tokens of an eager engine (fp32, base and adapter rows, chunked prompts, a
cached prefix), and a bf16 7b-shaped step's logits stay within bf16 rounding of eager."""
import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from tests.engine.test_prefill_graphs import tiny_model_and_adapters
from tests.helpers.models import random_prompts, save_hf_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("lora", [False, True])
def test_prefill_graphs_match_eager(tmp_path, lora):
    base, adapters = tiny_model_and_adapters(tmp_path, lora)
    prompts = random_prompts(9, [5, 17, 40, 3, 29, 70, 64, 1, 100], base.config.vocab_size, seed=4)
    prompts += [prompts[2][:20] + p for p in random_prompts(3, [4, 9, 31], base.config.vocab_size, 5)]
    names = [None, "qv", "all"] if lora else [None]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = [Request(i, p, sp, adapter=names[i % len(names)]) for i, p in enumerate(prompts)]
    base_reqs = [Request(100 + i, p, sp) for i, p in enumerate(prompts[:5])]

    def engine(eager):
        cfg = EngineConfig(model=str(tmp_path / "base"), device="cuda", dtype="float32",
                           max_model_len=256, max_num_seqs=8, max_num_batched_tokens=96,
                           enable_lora=lora, max_loras=2, max_lora_rank=8, enforce_eager=eager)
        return Engine.from_config(cfg, adapters or None)

    want = [[r.output_token_ids for r in e.generate(x)] for e in [engine(True)] for x in (reqs, base_reqs)]
    graphs = engine(False)
    pg = graphs.runner.prefill_graphs
    assert pg is not None and pg.sizes == [16, 32, 64, 96]
    sets = 1 + (len(graphs.lora.slot_bounds) if lora else 0)  # no-LoRA + one per slot bound
    assert len(pg.pieces) == len(pg.sizes) * sets
    got = [[r.output_token_ids for r in graphs.generate(x)] for x in (reqs, base_reqs)]
    assert pg.replays > 0
    assert got == want


def test_prefill_graphs_bf16_logits_near_eager(tmp_path):
    # bf16: the padded GEMMs may round differently from the unpadded eager ones, so the first
    # token's logits are compared within bf16 rounding, not bit for bit
    save_hf_model("llama3_gqa", tmp_path / "base")
    prompts = random_prompts(4, [7, 30, 12, 50], 200, seed=9)
    out = {}
    for eager in (True, False):
        cfg = EngineConfig(model=str(tmp_path / "base"), device="cuda", dtype="bfloat16",
                           max_model_len=128, max_num_seqs=4, enforce_eager=eager,
                           enable_prefix_caching=False)
        e = Engine.from_config(cfg)
        sp = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=5)
        out[eager] = e.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
        if not eager:
            assert e.runner.prefill_graphs.replays > 0
    for a, b in zip(out[True], out[False]):
        assert a.logprobs == pytest.approx(b.logprobs, abs=0.05)
