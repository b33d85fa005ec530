"""The checks every model family's GPU tests make, written once (tests/gpu/test_engine_gpu.py,
tests/gpu/test_families_gpu.py, tests/engine/test_moe_gpu.py call them with their variants;
their fp32 greedy check is tests/helpers/models.py's `greedy_matches_hf`, shared with the CPU):

- `bf16_parity`: bf16 logits and greedy tokens track an fp32 reference of the same weights as
  closely as transformers' own bf16 does (bf16 rounding differs between any two
  implementations and grows over a random model's layers, so HF's error is the yardstick);
- `graph_replay_matches_eager` and `no_lora_step_kernels`: over an engine with peft adapters
  (`lora_engine`) and a batch mixing base and adapter rows (`mixed_requests`);
- the `skinny` fixture: the tiny models' projections on the Triton decode GEMM, or on cuBLAS.
"""
from __future__ import annotations

import collections

import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.models.loader import model_from_hf_state
from batchrun.engine.request import Request
from batchrun.engine.sequence import Sequence
from tests.helpers.adapters import parity_adapter
from tests.helpers.models import random_prompts, save_hf_model

# two peft adapters on every linear layer, of different ranks
ALL_LINEAR = {"a0": dict(r=8, lora_alpha=16, target_modules="all-linear"),
              "a1": dict(r=4, lora_alpha=8, target_modules="all-linear")}


def bf16_parity(conf, model_cls: str, label: str, prompt_len: int, new_tokens: int,
                perturb_norms: bool = True, logits: bool = True) -> None:
    """conf: a transformers config of the model to build on the GPU with random weights;
    perturb_norms: random norm scales, as trained models have (a norm whose scale the engine
    dropped or mis-offset would then show); logits: also the first step's logits."""
    import transformers
    torch.manual_seed(0)
    conf._attn_implementation = "eager"
    with torch.device("cuda"):
        hf = getattr(transformers, model_cls)(conf).to(torch.bfloat16).eval()
        if perturb_norms:
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.data.add_(torch.randn_like(p) * 0.1)
    # the config transformers built (every field its class defaults), as a checkpoint holds it
    cfg = ModelConfig.from_dict(dict(hf.config.to_dict(), architectures=[model_cls],
                                     torch_dtype="bfloat16"))
    ours = model_from_hf_state(cfg, hf.state_dict(), torch.device("cuda"), torch.bfloat16, 4096)
    engine = Engine.from_model(EngineConfig(model=label, max_model_len=512, max_num_seqs=8), ours)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 32000, (prompt_len,), generator=g).tolist() for _ in range(8)]
    ids = torch.tensor(prompts, device="cuda")
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf_bf16 = hf(ids).logits[:, -1].float()
        hf_tokens = hf.generate(ids, **gen)[:, prompt_len:].tolist()
        hf.float()
        ref = hf(ids).logits[:, -1].float()  # fp32 reference, same weights
        fp32_tokens = hf.generate(ids, **gen)[:, prompt_len:].tolist()
    del hf
    torch.cuda.empty_cache()
    if logits:
        sched = engine.scheduler()
        for i, p in enumerate(prompts):
            sched.add(Sequence(i, i, p, SamplingParams(), None, None))
        batch = sched.schedule()
        assert batch.is_prefill and batch.num_tokens == [prompt_len] * 8
        got = engine.runner.prefill(batch)
        for seq in list(sched.running):
            sched.finish(seq, "length")
        err = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
        print(f"{label}: first-step logits rel err vs fp32: ours {err(got):.2e}, "
              f"HF bf16 {err(hf_bf16):.2e}")
        assert err(got) <= 1.5 * err(hf_bf16) + 1e-3
    res = engine.generate([Request(i, p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
                           for i, p in enumerate(prompts)])
    ours_tokens = [r.output_token_ids for r in res]
    rate = lambda a, b: (sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))  # noqa: E731
                         / (8 * new_tokens))
    print(f"{label}: greedy match over 8x{new_tokens}: ours/fp32 "
          f"{rate(ours_tokens, fp32_tokens):.3f}, HF bf16/fp32 {rate(hf_tokens, fp32_tokens):.3f}, "
          f"ours/HF bf16 {rate(ours_tokens, hf_tokens):.3f}")
    # after a first divergence continuations differ by construction; ours must track the fp32
    # reference about as well as HF bf16 does
    assert rate(ours_tokens, fp32_tokens) >= 0.8 * rate(hf_tokens, fp32_tokens) - 0.05


def lora_engine(tmp_path, variant: str, enforce_eager: bool, enable_lora: bool = True,
                dtype: str = "float32", adapters: dict | None = None, max_loras: int = 2,
                max_lora_rank: int = 8, **engine):
    """A tiny `variant` engine on the GPU and its peft adapters (name -> LoraConfig kwargs,
    random weights; default ALL_LINEAR) -> (engine, {name: dir})."""
    save_hf_model(variant, tmp_path / "base")
    dirs = {}
    for i, (name, kw) in enumerate((adapters or ALL_LINEAR).items()):
        parity_adapter(variant, tmp_path / name, 300 + i, kw)
        dirs[name] = str(tmp_path / name)
    cfg = EngineConfig(model=str(tmp_path / "base"), device="cuda", dtype=dtype, max_model_len=256,
                       max_num_seqs=16, enable_lora=enable_lora, max_loras=max_loras,
                       max_lora_rank=max_lora_rank, enforce_eager=enforce_eager, **engine)
    return Engine.from_config(cfg, dirs if enable_lora else None), dirs


def mixed_requests(adapters: dict, vocab: int = 211) -> list[Request]:
    """11 requests of varied lengths, base rows and each adapter's in turn."""
    names = [None] + sorted(adapters)
    prompts = random_prompts(11, [5, 70, 17, 90, 3], vocab, seed=2)
    return [Request(i, p, SamplingParams(max_tokens=24, ignore_eos=True), names[i % len(names)])
            for i, p in enumerate(prompts)]


def graph_replay_matches_eager(tmp_path, variant: str, **engine) -> None:
    eager, adapters = lora_engine(tmp_path / "e", variant, True, **engine)
    graphs, _ = lora_engine(tmp_path / "g", variant, False, **engine)
    assert graphs.runner.graphs is not None
    reqs = mixed_requests(adapters)
    assert ([r.output_token_ids for r in eager.generate(reqs)]
            == [r.output_token_ids for r in graphs.generate(reqs)])


def no_lora_step_kernels(tmp_path, variant: str, skinny: bool, **engine) -> None:
    """A decode step of base rows on a LoRA engine launches exactly the LoRA-disabled engine's
    kernels."""
    dtype = "bfloat16" if skinny else "float32"  # the skinny GEMM takes 16-bit types only
    base, adapters = lora_engine(tmp_path / "a", variant, True, enable_lora=False, dtype=dtype, **engine)
    lora, _ = lora_engine(tmp_path / "b", variant, True, enable_lora=True, dtype=dtype, **engine)
    prompts = [r.prompt_token_ids for r in mixed_requests(adapters)[:8]]
    k_base = kernels_of_one_decode_step(base, prompts)
    k_lora = kernels_of_one_decode_step(lora, prompts)
    assert sum(k_base.values()) > 0
    assert k_lora == k_base, f"extra: {k_lora - k_base}, missing: {k_base - k_lora}"


def kernels_of_one_decode_step(engine, prompts) -> collections.Counter:
    """The CUDA kernels one eager decode step of `prompts` launches (names and counts)."""
    from torch.profiler import ProfilerActivity, profile
    from batchrun.engine.scheduler import Scheduler
    sched = Scheduler(engine.config, engine.blocks, engine.lora)
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, i, p, SamplingParams(max_tokens=8, ignore_eos=True), None, None))
    engine.step(sched)  # prefill
    batch = sched.schedule()
    assert not batch.is_prefill
    runner = engine.runner
    with runner.eager():  # eager: the profiler sees every launch
        # warm up once (first launches compile and allocate), so the profile holds only what
        # every step launches
        runner.decode(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.decode(batch)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return collections.Counter(n for n in names if "Memcpy" not in n and "Memset" not in n)


@pytest.fixture(params=["cublas", "skinny"])
def skinny(request, monkeypatch):
    """True ("skinny"): every projection of the tiny models takes the Triton decode GEMM on
    steps of <= 16 rows (the size rule lowered to 0), as the 7b projections do, so the LoRA
    decode tests cover the stacked [W; A] skinny GEMM and gate_up's fused GEMM with the norm's
    shrink."""
    import batchrun.engine.step_plan as step_plan
    if request.param == "skinny":
        monkeypatch.setattr(step_plan, "MIN_WEIGHT_ELEMENTS", 0)
    return request.param != "cublas"
