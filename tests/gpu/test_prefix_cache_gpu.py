"""Prefix caching on the GPU: greedy tokens with caching on and off on a ~1B-shaped random
model (GQA), base and LoRA rows sharing prefixes (one ending mid-block, one on a block edge),
chunked prefill, CUDA graphs on, and four rows with one prompt (sampling.n's case).

In float32. With caching a row's uncached tail is computed in a different batch shape than
without, so the last bits differ; in bf16 on random weights (near-flat logits) that flips
tokens at near-ties in most rows and proves nothing (it did on the H200). In float32 the runs
agree to ~1e-6, so a row may diverge only where both runs' top tokens tie within TIE_NATS; reused
K/V that is wrong (another adapter's, a stale block, an off-by-one position) diverges at a
clear gap (~0.3 nats on average here)."""
import gc

import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.envs import Experiments
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from batchrun.engine.models.config import ModelConfig

pytestmark = pytest.mark.gpu

SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
             hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="bfloat16", bos_token_id=1,
             eos_token_id=2)
NEW = 32
TIE_NATS = 1e-3


def _requests():
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(100, 32000, (n,), generator=g).tolist()  # noqa: E731
    p300, p512 = rand(300), rand(512)  # 300 = 18 blocks + 12 tokens; 512 = 32 blocks
    tails = [0, 7, 16, 33, 64, 100]
    names = [None, "lora0", None, "lora1", None, "lora0"]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=5)
    reqs = [Request(i, (p300 if i % 2 else p512) + rand(tails[i % len(tails)]), sp,
                    adapter=names[(i // 2) % len(names)]) for i in range(24)]
    same = rand(200)
    reqs += [Request(("n", k), same, sp) for k in range(4)]
    return reqs


def _run(model, adapters, caching: bool):
    cfg = EngineConfig(model="random-1b", device="cuda", dtype="float32", max_model_len=1024,
                       max_num_seqs=16, max_num_batched_tokens=1024,
                       experiments=Experiments(num_kv_blocks=2048),
                       enable_lora=True, max_loras=2, max_lora_rank=16,
                       enable_prefix_caching=caching)
    engine = Engine.from_model(cfg, model, None, adapters)
    try:
        out = engine.generate(_requests())
        return out, dict(engine.stats)
    finally:
        del engine  # the next engine binds the model's attention layers to its own KV cache
        gc.collect()
        torch.cuda.empty_cache()


def test_greedy_tokens_identical_with_and_without_prefix_caching(tmp_path):
    from batchrun.bench.adapters import write_random_adapters
    from batchrun.engine.models.loader import random_model
    mcfg = ModelConfig.from_dict(dict(SHAPE))
    model = random_model(mcfg, torch.device("cuda"), torch.float32, 2048, seed=0)
    adapters = write_random_adapters(tmp_path, mcfg, 2, 16, seed=0, base_model="random-1b")
    assert sorted(adapters) == ["lora0", "lora1"]
    off, off_stats = _run(model, adapters, caching=False)
    on, on_stats = _run(model, adapters, caching=True)
    print(f"prefix cache: {on_stats['prefix_cache_hit_tokens']} of "
          f"{on_stats['prefix_cache_queried_tokens']} prompt tokens hit; "
          f"prefill steps on {on_stats['prefill_steps']} / off {off_stats['prefill_steps']}")
    assert on_stats["prefix_cache_hit_tokens"] > 0 and off_stats["prefix_cache_hit_tokens"] == 0
    reqs = _requests()
    same, bad = 0, []
    for req, a, b in zip(reqs, on, off):
        ta, tb = a.output_token_ids, b.output_token_ids
        j = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if j is None:
            same += 1
            continue
        gaps = []
        for r in (a, b):  # both tokens in this run's top 5, and how far apart
            top = dict(r.top_logprobs[j])
            gaps.append(abs(top[ta[j]] - top[tb[j]]) if ta[j] in top and tb[j] in top else None)
        if any(g is None or g > TIE_NATS for g in gaps):
            bad.append((req.request_id, req.adapter, j, gaps))
    print(f"prefix cache on vs off: {same}/{len(reqs)} rows identical")
    assert not bad, f"rows diverging at a clear gap with caching on (id, adapter, position, gaps): {bad}"
