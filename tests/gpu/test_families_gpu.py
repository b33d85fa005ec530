"""GPU checks per model family (Qwen3, Gemma 2/3, Phi-3, the sliding-window variants): the
Triton path's fp32 greedy tokens equal transformers', bf16 logits and tokens track fp32 as
closely as transformers' bf16 does, graph replay equals eager with adapters mixed in, and a
no-LoRA decode step launches exactly the LoRA-disabled engine's kernels."""
import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.models.loader import model_from_hf_state
from batchrun.engine.request import Request
from tests.gpu.test_engine_gpu import _kernels_of_one_decode_step, skinny  # noqa: F401 (fixture)
from tests.helpers.adapters import parity_adapter
from tests.helpers.models import FAMILIES, hf_greedy, random_prompts, save_hf_model

pytestmark = pytest.mark.gpu

VARIANTS = ["qwen3", "qwen3_tied_window", "gemma2", "gemma3", "phi3_longrope", "phi3_window",
            "mistral_window", "qwen2_window"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_greedy_matches_hf_on_the_triton_path(tmp_path, variant):
    hf = save_hf_model(variant, tmp_path / "m")
    prompts = random_prompts(6, [1, 7, 33, 200, 64, 3], hf.config.vocab_size, seed=1)
    engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device="cuda",
                                             dtype="float32", max_model_len=512,
                                             max_num_batched_tokens=256))
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    results = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        assert r.output_token_ids == hf_greedy(hf, p, 40), f"prompt len {len(p)}"


@pytest.mark.parametrize("variant", ["qwen3", "gemma2", "gemma3", "phi3_longrope"])
def test_fp32_lora_matches_peft_on_the_triton_path(tmp_path, variant):
    # fused decode steps: Qwen3's and Gemma 3's qkv delta added before the q/k norms
    # (lora/layer.py add_delta), Gemma's norms and GeGLU taking the deltas
    from tests.engine.test_family_lora import check_family_lora
    check_family_lora(tmp_path, variant, "cuda")


# mid-sized random models of each family: windows shorter than prompt + output
MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
           num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
           rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
MID_FAMILIES = {
    "qwen3": dict(MID, head_dim=128),
    "gemma2": dict(MID, head_dim=256, query_pre_attn_scalar=256, sliding_window=64,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(MID, head_dim=256, query_pre_attn_scalar=256, sliding_window=64,
                        sliding_window_pattern=2),
    "phi3": dict(MID, sliding_window=64),
}


@pytest.mark.parametrize("family", sorted(MID_FAMILIES))
def test_bf16_parity_with_hf(family):
    """As the Llama-2-7b test: bf16 error against an fp32 reference no worse than HF's own."""
    import transformers
    conf_cls, model_cls = FAMILIES[family]
    raw = MID_FAMILIES[family]
    torch.manual_seed(0)
    conf = getattr(transformers, conf_cls)(**raw)
    conf._attn_implementation = "eager"
    with torch.device("cuda"):
        hf = getattr(transformers, model_cls)(conf).to(torch.bfloat16).eval()
        for name, p in hf.named_parameters():  # random norm scales, as trained models have
            if name.endswith("norm.weight"):
                p.data.add_(torch.randn_like(p) * 0.1)
    cfg = ModelConfig.from_dict(dict(raw, architectures=[model_cls], model_type=family,
                                     torch_dtype="bfloat16"))
    ours = model_from_hf_state(cfg, hf.state_dict(), torch.device("cuda"), torch.bfloat16, 4096)
    engine = Engine.from_model(EngineConfig(model=family, max_model_len=512, max_num_seqs=8), ours)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 32000, (96,), generator=g).tolist() for _ in range(8)]
    ids = torch.tensor(prompts, device="cuda")
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=64, min_new_tokens=64,
               do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf_bf16 = hf(ids).logits[:, -1].float()
        hf_tokens = hf.generate(ids, **gen)[:, 96:].tolist()
        hf.float()
        ref = hf(ids).logits[:, -1].float()
        fp32_tokens = hf.generate(ids, **gen)[:, 96:].tolist()
    del hf
    torch.cuda.empty_cache()
    from batchrun.engine.sequence import Sequence
    sched = engine.scheduler()
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, i, p, SamplingParams(), None, None))
    batch = sched.schedule()
    got = engine.runner.prefill(batch)
    for seq in list(sched.running):
        sched.finish(seq, "length")
    err = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    print(f"{family}: first-step logits rel err vs fp32: ours {err(got):.2e}, HF bf16 {err(hf_bf16):.2e}")
    assert err(got) <= 1.5 * err(hf_bf16) + 1e-3
    res = engine.generate([Request(i, p, SamplingParams(max_tokens=64, ignore_eos=True))
                           for i, p in enumerate(prompts)])
    ours_tokens = [r.output_token_ids for r in res]
    rate = lambda a, b: sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / (8 * 64)  # noqa: E731
    print(f"{family}: greedy match ours/fp32 {rate(ours_tokens, fp32_tokens):.3f}, "
          f"HF bf16/fp32 {rate(hf_tokens, fp32_tokens):.3f}")
    assert rate(ours_tokens, fp32_tokens) >= 0.8 * rate(hf_tokens, fp32_tokens) - 0.05


def _engine(tmp_path, variant, enforce_eager, enable_lora=True, dtype="float32"):
    save_hf_model(variant, tmp_path / "base")
    adapters = {}
    for i, kw in enumerate([dict(r=8, lora_alpha=16, target_modules="all-linear"),
                            dict(r=4, lora_alpha=8, target_modules="all-linear")]):
        parity_adapter(variant, tmp_path / f"a{i}", 300 + i, kw)
        adapters[f"a{i}"] = str(tmp_path / f"a{i}")
    cfg = EngineConfig(model=str(tmp_path / "base"), device="cuda", dtype=dtype, max_model_len=256,
                       max_num_seqs=16, enable_lora=enable_lora, max_loras=2, max_lora_rank=8,
                       enforce_eager=enforce_eager)
    return Engine.from_config(cfg, adapters if enable_lora else None), adapters


def _requests(adapters, vocab):
    names = [None] + sorted(adapters)
    prompts = random_prompts(11, [5, 70, 17, 90, 3], vocab, seed=2)
    return [Request(i, p, SamplingParams(max_tokens=24, ignore_eos=True), names[i % len(names)])
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("variant", ["qwen3", "gemma2", "gemma3", "phi3_longrope"])
def test_graph_replay_matches_eager(tmp_path, variant):
    eager, adapters = _engine(tmp_path / "e", variant, True)
    graphs, _ = _engine(tmp_path / "g", variant, False)
    assert graphs.runner.graphs is not None
    reqs = _requests(adapters, 211)
    assert ([r.output_token_ids for r in eager.generate(reqs)]
            == [r.output_token_ids for r in graphs.generate(reqs)])


@pytest.mark.parametrize("variant", ["qwen3", "gemma2", "gemma3", "phi3_longrope"])
def test_no_lora_step_launches_exactly_the_lora_disabled_kernels(tmp_path, variant, skinny):  # noqa: F811
    dtype = "bfloat16" if skinny else "float32"
    base, adapters = _engine(tmp_path / "a", variant, True, enable_lora=False, dtype=dtype)
    lora, _ = _engine(tmp_path / "b", variant, True, enable_lora=True, dtype=dtype)
    prompts = [r.prompt_token_ids for r in _requests(adapters, 211)[:8]]
    k_base = _kernels_of_one_decode_step(base, prompts)
    k_lora = _kernels_of_one_decode_step(lora, prompts)
    assert sum(k_base.values()) > 0
    assert k_lora == k_base, f"extra: {k_lora - k_base}, missing: {k_base - k_lora}"
