"""Prefix caching in the engine (CPU fp32): the same tokens with caching on and off for rows
sharing a prefix (base and LoRA rows, chunked prefill, prefixes ending mid-block and on a block
edge, preemption), adapter isolation seen in the hit counter, and the n samples of a row sharing
its prompt's blocks."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.envs import Experiments
from batchrun.engine.engine import Engine
from batchrun.engine.request import Request
from tests.helpers.adapters import save_peft_adapters
from tests.helpers.models import random_prompts, save_hf_model

NEW = 8
BS = 16
NAMES = ["a", "b"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    save_hf_model("llama3_gqa", root / "base", seed=3)
    adapters = save_peft_adapters(root, NAMES, seed=20)
    return str(root / "base"), adapters


def make_engine(dirs, caching, **cfg):
    base, adapters = dirs
    kw = dict(model=base, device="cpu", max_model_len=256, max_num_seqs=8, enable_lora=True,
              max_loras=2, max_lora_rank=4, block_size=BS, enable_prefix_caching=caching)
    kw.update(cfg)
    return Engine.from_config(EngineConfig(**kw), adapters=adapters)


@pytest.fixture(scope="module")
def engines(dirs):
    return {on: make_engine(dirs, on) for on in (True, False)}


def shared_prefix_requests(sp=None):
    """Rows over two prefixes, 37 tokens (ends mid-block) and 32 (on a block edge), with own
    tails of 0..20 tokens (0: the prompt is the prefix), base and adapter rows mixed."""
    sp = sp or SamplingParams(max_tokens=NEW, ignore_eos=True)
    p37, p32 = random_prompts(2, [37, 32], 211, seed=11)
    tails = random_prompts(12, [0, 1, 5, 12, 20, 16], 211, seed=12)
    names = [None, None, "a", None, "a", "b", None, "b", "a", None, None, "a"]
    reqs = []
    for i, (tail, name) in enumerate(zip(tails, names)):
        prefix = p37 if i % 3 else p32
        reqs.append(Request(i, prefix + tail, sp, adapter=name))
    return reqs


def tokens(engine, reqs):
    return [r.output_token_ids for r in engine.generate(reqs)]


def hits(engine, reqs):
    """Generate from a cold cache; returns (outputs, hit tokens, queried tokens)."""
    engine.blocks.reset_cache()
    h0, q0 = engine.stats["prefix_cache_hit_tokens"], engine.stats["prefix_cache_queried_tokens"]
    out = tokens(engine, reqs)
    return (out, engine.stats["prefix_cache_hit_tokens"] - h0,
            engine.stats["prefix_cache_queried_tokens"] - q0)


@pytest.mark.parametrize("budget", [2048, 24])  # 24: chunks end mid-block and mid-prefix
def test_outputs_identical_with_and_without_caching(dirs, budget):
    on, off = make_engine(dirs, True, max_num_batched_tokens=budget), \
        make_engine(dirs, False, max_num_batched_tokens=budget)
    reqs = shared_prefix_requests()
    want = tokens(off, reqs)
    got, hit, queried = hits(on, reqs)
    assert got == want
    assert queried == sum(len(r.prompt_token_ids) for r in reqs)
    assert hit > 0 and hit % BS == 0
    assert off.stats["prefix_cache_hit_tokens"] == off.stats["prefix_cache_queried_tokens"] == 0
    # a second pass over the same rows finds their prompts cached (all but each last token)
    again = tokens(on, reqs)
    assert again == want


def test_sampled_rows_identical_with_and_without_caching(engines):
    sp = SamplingParams(max_tokens=NEW, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    reqs = shared_prefix_requests(sp)
    assert hits(engines[True], reqs)[0] == tokens(engines[False], reqs)


def _recording_block_ids(engine):
    seen = []
    orig = engine.runner.prefill

    def prefill(batch, *args):
        seen.extend((s.request_id, s.adapter, list(s.block_ids), start)
                    for s, start in zip(batch.seqs, batch.starts))
        return orig(batch, *args)
    engine.runner.prefill = prefill
    return seen, orig


def test_lora_row_never_reuses_base_or_other_adapter_blocks(engines):
    engine = engines[True]
    prompt = random_prompts(1, [48], 211, seed=21)[0]
    sp = SamplingParams(max_tokens=NEW, ignore_eos=True)
    engine.blocks.reset_cache()
    seen, orig = _recording_block_ids(engine)
    try:
        got = []
        for rid, name in (("base", None), ("a1", "a"), ("b1", "b"), ("a2", "a"), ("base2", None)):
            h0 = engine.stats["prefix_cache_hit_tokens"]
            engine.generate([Request(rid, prompt, sp, adapter=name)])
            got.append(engine.stats["prefix_cache_hit_tokens"] - h0)
    finally:
        engine.runner.prefill = orig
    # 47 // 16 = 2 blocks at most; only a row of the same adapter (or base) finds them
    assert got == [0, 0, 0, 2 * BS, 2 * BS]
    first = {rid: blocks[:2] for rid, _, blocks, _ in seen if rid in ("base", "a1", "b1")}
    assert not set(first["base"]) & set(first["a1"]) and not set(first["a1"]) & set(first["b1"])
    blocks = {rid: b for rid, _, b, _ in seen}
    assert blocks["a2"][:2] == blocks["a1"][:2] and blocks["base2"][:2] == blocks["base"][:2]


def test_n_samples_share_the_prompt_blocks(engines):
    """sampling.n > 1 reaches the engine as n requests with the same prompt (rows.build_unit),
    adjacent in the stream: they are admitted in one prefill step, and each sample after the
    first takes the blocks the first registered while that step was planned."""
    engine = engines[True]
    prompt = random_prompts(1, [40], 211, seed=31)[0]
    reqs = [Request(("row", k), prompt, SamplingParams(max_tokens=NEW, temperature=1.0, seed=100 + k,
                                                       ignore_eos=True)) for k in range(4)]
    engine.blocks.reset_cache()
    seen, orig = _recording_block_ids(engine)
    h0 = engine.stats["prefix_cache_hit_tokens"]
    try:
        got = tokens(engine, reqs)
    finally:
        engine.runner.prefill = orig
    assert engine.stats["prefix_cache_hit_tokens"] - h0 == 3 * 2 * BS  # (40 - 1) // 16 = 2 blocks
    assert len(seen) == 4  # one prefill step: all four admitted together
    shared = seen[0][2][:2]
    assert all(b[:2] == shared for _, _, b, _ in seen)
    assert [n for *_, n in seen] == [0, 2 * BS, 2 * BS, 2 * BS]
    assert len({b[2] for _, _, b, _ in seen}) == 4  # each sample's partial block is its own
    assert got == tokens(engines[False], reqs)
    assert len({tuple(t) for t in got}) > 1  # the samples differ (their seeds do)


def test_preemption_with_a_shared_prefix(dirs, engines):
    """A KV cache too small for every row at once: rows are preempted and re-admitted (finding
    their own and their neighbours' blocks); the tokens stay those of the uncached engine."""
    reqs = shared_prefix_requests()
    want = tokens(engines[False], reqs)
    tight = make_engine(dirs, True, experiments=Experiments(num_kv_blocks=12), max_num_batched_tokens=40, max_model_len=80)
    prefilled = []
    real = tight.runner.prefill
    tight.runner.prefill = lambda batch, *a: (prefilled.append(sum(batch.num_tokens)), real(batch, *a))[1]
    got = tokens(tight, reqs)
    st = tight.stats
    assert st["preemptions"] > 0
    assert got == want
    # every admission (re-admissions too) prefills what it did not find cached
    assert sum(prefilled) == st["prefix_cache_queried_tokens"] - st["prefix_cache_hit_tokens"]
    assert st["recomputed_tokens"] >= 0
    assert tight.blocks.num_free == 11 and all(r == 0 for r in tight.blocks.pool.ref_count)
