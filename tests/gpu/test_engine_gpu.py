"""GPU-only engine checks (run on the H200): bf16 parity with HF on a Llama-2-7b-shaped random
model, graph replay vs eager, and the no-LoRA graph launching exactly the LoRA-disabled kernels."""
import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.envs import Experiments
from batchrun.engine.request import Request
from tests.helpers.gpu_checks import (bf16_parity, kernels_of_one_decode_step, lora_engine,
                                      skinny)  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu

LLAMA2_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000,
                 hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def test_bf16_parity_with_hf_llama2_7b_shape():
    from transformers import LlamaConfig
    conf = LlamaConfig(**{k: v for k, v in LLAMA2_7B.items() if k not in ("architectures", "model_type")})
    bf16_parity(conf, "LlamaForCausalLM", "llama-2-7b", prompt_len=32, new_tokens=128,
                perturb_norms=False)


def _tiny_lora_engine(tmp_path, enforce_eager, enable_lora=True, dtype="float32", **engine):
    from tests.helpers.adapters import ADAPTERS  # real peft adapters, random weights
    return lora_engine(tmp_path, "llama3_gqa", enforce_eager, enable_lora, dtype, adapters=ADAPTERS,
                       max_loras=4, max_lora_rank=16, **engine)


def _requests(adapters, mixed):
    g = torch.Generator().manual_seed(1)
    names = [None] + sorted(adapters) if mixed else [None]
    return [Request(i, torch.randint(3, 200, (5 + 3 * i,), generator=g).tolist(),
                    SamplingParams(max_tokens=24, ignore_eos=True), names[i % len(names)])
            for i in range(11)]


@pytest.mark.parametrize("mixed", [False, True])
def test_graph_replay_matches_eager(tmp_path, mixed):
    eager, adapters = _tiny_lora_engine(tmp_path / "e", True)
    graphs, _ = _tiny_lora_engine(tmp_path / "g", False)
    assert graphs.runner.graphs is not None and graphs.runner.graphs.stats["num_graphs"] > 0
    reqs = _requests(adapters, mixed)
    a = [r.output_token_ids for r in eager.generate(reqs)]
    b = [r.output_token_ids for r in graphs.generate(reqs)]
    assert a == b


@pytest.mark.parametrize("mixed", [False, True])
def test_pdl_changes_no_bit(tmp_path, monkeypatch, mixed):
    # bf16, captured graphs: programmatic dependent launch (BATCHRUN_PDL, on) against plain
    # launches, same engine, graphs recaptured per setting (and PDL on twice). The math is the
    # same, so the tokens and every decode step's logits must be bit-equal; a kernel that read
    # or wrote before its gdc_wait would race and show here.
    import batchrun.kernels.pdl as pdl  # on unless BATCHRUN_PDL=0; the test flips its constant
    # prefix caching off: a later run would reuse the first run's KV blocks, computed by other
    # kernels (decode, not prefill), and differ from it in bf16 with or without PDL (H100:
    # the first run's tokens differed from every later run's, PDL on or off, eager or graphs)
    engine, adapters = _tiny_lora_engine(tmp_path, False, dtype="bfloat16",
                                         enable_prefix_caching=False)
    runner, reqs, runs = engine.runner, _requests(adapters, mixed), {}
    logits = []  # every decode step's logits (graph replays included)
    orig = runner.decode
    runner.decode = lambda *a, **k: (lambda r: (logits.append(r.clone()), r)[1])(orig(*a, **k))
    try:
        for on in (True, False, True):
            monkeypatch.setattr(pdl, "ENABLED", on)
            runner._graphs = None
            runner.capture_graphs()
            logits.clear()
            toks = [r.output_token_ids for r in engine.generate(reqs)]
            runs.setdefault(on, []).append((toks, [t.cpu() for t in logits]))
    finally:
        runner.decode = orig
    (a_toks, a_logits), (b_toks, b_logits) = runs[True][0], runs[False][0]
    assert a_toks == b_toks == runs[True][1][0]
    assert len(a_logits) == len(b_logits) > 0
    assert all(torch.equal(x, y) for x, y in zip(a_logits, b_logits))


def test_async_steps_match_sync_and_never_wait_for_the_device(tmp_path, monkeypatch):
    """Graphs, adapters, rows ending on a stop token, seeded sampled rows with logprobs: the
    async loop gives the synchronous loop's tokens, and launching a decode step (inputs, graph
    replay, sampling, the copies of its tokens) never synchronises with the device, which is
    what lets the host plan the next step while this one runs (torch's sync debug mode raises
    on any synchronising call)."""
    engine, adapters = _tiny_lora_engine(tmp_path, False)
    assert engine.runner.graphs is not None
    base = engine.generate(_requests(adapters, True))
    reqs = []
    for i, (r, b) in enumerate(zip(_requests(adapters, True), base)):
        if i % 3 == 1:
            sp = SamplingParams(max_tokens=24, stop_token_ids=(b.output_token_ids[5 + i % 4],))
        elif i % 3 == 2:
            sp = SamplingParams(max_tokens=20, temperature=0.7, top_k=20, top_p=0.9, seed=i,
                                logprobs=2, ignore_eos=True)
        else:
            sp = r.sampling
        reqs.append(Request(r.request_id, r.prompt_token_ids, sp, r.adapter))
    monkeypatch.setattr(engine.config, "experiments", Experiments(async_scheduling=False))
    want = engine.generate(reqs)
    monkeypatch.setattr(engine.config, "experiments", Experiments(async_scheduling=True))
    launched = []
    orig = engine.executor.execute

    def execute(batch, prev):
        if batch.is_prefill:  # prefill steps copy their inputs from pageable memory: they wait
            return orig(batch, prev)
        launched.append(sum(1 for j in batch.pending_rows if j >= 0))
        torch.cuda.set_sync_debug_mode("error")
        try:
            return orig(batch, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(engine.executor, "execute", execute)
    got = engine.generate(reqs)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert any(r.finish_reason == "stop" for r in want) and any(r.logprobs for r in want)
    for g, w in zip(got, want):
        if w.logprobs:
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert sum(launched) > 0  # decode steps did read tokens still on the device


def test_no_lora_step_launches_exactly_the_lora_disabled_kernels(tmp_path, skinny):  # noqa: F811
    dtype = "bfloat16" if skinny else "float32"  # the skinny GEMM takes 16-bit types only
    base, adapters = _tiny_lora_engine(tmp_path / "a", True, enable_lora=False, dtype=dtype)
    lora, _ = _tiny_lora_engine(tmp_path / "b", True, enable_lora=True, dtype=dtype)
    prompts = [r.prompt_token_ids for r in _requests(adapters, False)[:8]]
    k_base = kernels_of_one_decode_step(base, prompts)
    k_lora = kernels_of_one_decode_step(lora, prompts)
    assert sum(k_base.values()) > 0
    assert any("skinny" in k for k in k_base) == skinny, k_base  # the fixture took effect
    assert k_lora == k_base, f"extra: {k_lora - k_base}, missing: {k_base - k_lora}"


def test_fused_lora_decode_is_as_accurate_as_shrink_expand(tmp_path, monkeypatch, skinny):  # noqa: F811
    """One bf16 decode step of a mixed batch (base rows + 4 adapters): the fused path (delta
    added inside rotary / norm / SiLU, graphs and eager) against the shrink + expand path, both
    measured against the same engine in fp32. Logits, not greedy tokens: a tiny random model's
    logits are nearly flat, so token match rates are mostly noise."""
    import batchrun.engine.model_runner as model_runner
    from benchmarks.step_probe import decoding_batch
    bf16, adapters = _tiny_lora_engine(tmp_path / "b", False, dtype="bfloat16")
    fp32, _ = _tiny_lora_engine(tmp_path / "f", True)
    names = [None, "qv", "all", "mlp1", None, "o", "all", "qv"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (4 + 5 * i,), generator=g).tolist() for i in range(8)]

    def logits(engine, graphs, fused):
        monkeypatch.setattr(model_runner, "use_triton", lambda t: fused)
        with decoding_batch(engine, prompts, names, graphs=graphs) as (runner, batch):
            return runner.decode(batch).float().clone()
    ref = logits(fp32, False, False)
    got = {"fused graph": logits(bf16, True, True), "fused eager": logits(bf16, False, True),
           "shrink+expand eager": logits(bf16, False, False)}
    err = {k: ((v - ref).norm() / ref.norm()).item() for k, v in got.items()}
    print("bf16 decode logits, relative error vs fp32:", err)
    assert err["shrink+expand eager"] < 0.05  # bf16 noise, not a broken path
    assert err["fused graph"] <= 1.25 * err["shrink+expand eager"] + 1e-3
    assert err["fused eager"] <= 1.25 * err["shrink+expand eager"] + 1e-3


def test_low_slots_replay_the_lora_set_of_their_slot_bound(tmp_path, monkeypatch):
    """A decode step whose adapter rows all sit in slot 0 replays the LoRA graph set of slot
    bound 1 (its fused GEMMs stream one slot's A rows, not max_loras'), equal (to fp32 rounding:
    cuBLAS may pick another fp32 algorithm under capture) to the eager step of the same bound and
    to the shrink + expand path; a step with a row in slot 2
    dispatches to the set of bound 4. (fp32: with this test's large random adapters, bf16
    logits of any two LoRA paths that round at different points differ by up to ~50 % against
    fp32 -- measured on the H100, on the commit before slot bounds too -- so only fp32 can tell
    a wrong slot from rounding.)"""
    import batchrun.engine.model_runner as model_runner
    from benchmarks.step_probe import decoding_batch
    engine, adapters = _tiny_lora_engine(tmp_path / "f", False)
    assert engine.lora.slot_bounds == (1, 4)
    assert set(engine.runner.graphs.stats["pool_bytes"]) == {"no_lora", "lora_1", "lora_4"}
    names = ["all", None, "all", None, "all", "all", None, "all"]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 200, (3 + 4 * i,), generator=g).tolist() for i in range(8)]

    def logits(graphs, fused):
        monkeypatch.setattr(model_runner, "use_triton", lambda t: fused)
        with decoding_batch(engine, prompts, names, graphs=graphs) as (runner, batch):
            assert {s.lora_slot for s in batch.seqs} <= {-1, 0}  # the one adapter went to slot 0
            if graphs:
                assert runner.dispatch(len(batch.seqs), True, runner.lora.slot_bound(0))[1].lora_slots == 1
            return runner.decode(batch).float().clone()
    graph, eager = logits(True, True), logits(False, True)
    plain = logits(False, False)  # shrink + expand over the metadata, every slot
    assert ((graph - eager).norm() / eager.norm()).item() < 1e-5
    assert ((graph - plain).norm() / plain.norm()).item() < 1e-4
    with decoding_batch(engine, prompts[:3], ["qv", "mlp1", "o"], graphs=True) as (runner, batch):
        top = max(s.lora_slot for s in batch.seqs)
        assert top == 2 and runner.dispatch(3, True, runner.lora.slot_bound(top))[1].lora_slots == 4


def test_bf16_lora_parity_with_peft(tmp_path):
    """Mixed base + 5-adapter batch in bf16 with graphs on: greedy match rate against peft.

    A broken LoRA path loses most tokens of the adapter rows; bf16 rounding only flips a few
    near-ties (then the rest of that row drifts). Runs on this tiny random model (nearly flat
    logits) measured ours vs peft fp32 at 0.66 (shrink+expand) and 0.56 (fused), with peft bf16
    vs peft fp32 at 0.80, while the fused path's logits are *closer* to fp32 than the
    shrink+expand path's (test_fused_lora_decode_is_as_accurate_as_shrink_expand): the rate is
    noise at this level, so the bound only catches broken paths; the logits test judges
    precision."""
    from peft import PeftModel
    from tests.helpers.adapters import ADAPTERS, parity_adapter
    from tests.helpers.models import make_hf_model, random_prompts, save_hf_model
    variant = "llama3_gqa"
    save_hf_model(variant, tmp_path / "base")
    paths = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        paths[name] = str(tmp_path / name)
        parity_adapter(variant, paths[name], 100 + i, kw)
    names = [None, "qv", "all", "mlp1", None, "o", "all", "qkv", "qv", "mlp1", "o", "all", "qkv"]
    prompts = random_prompts(len(names), [5, 17, 40, 3, 29], 211, seed=3)
    engine = Engine.from_config(
        EngineConfig(model=str(tmp_path / "base"), device="cuda", dtype="bfloat16",
                     max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8),
        adapters=paths)
    new = 32
    res = engine.generate([Request(i, p, SamplingParams(max_tokens=new, ignore_eos=True), n)
                           for i, (p, n) in enumerate(zip(prompts, names))])

    def peft_tokens(dtype):
        out = []
        for p, n in zip(prompts, names):
            m = make_hf_model(variant)
            if n is not None:
                m = PeftModel.from_pretrained(m, paths[n])
            m = m.to("cuda", dtype).eval()
            ids = torch.tensor([p], device="cuda")
            with torch.no_grad():
                o = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)
            out.append(o[0, len(p):].tolist())
        return out

    bf16, fp32 = peft_tokens(torch.bfloat16), peft_tokens(torch.float32)
    ours = [r.output_token_ids for r in res]
    rate = lambda a, b: sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / (len(a) * new)  # noqa: E731
    print(f"LoRA bf16 greedy match: ours vs peft bf16 {rate(ours, bf16):.3f}, ours vs peft fp32 "
          f"{rate(ours, fp32):.3f}, peft bf16 vs peft fp32 {rate(bf16, fp32):.3f}")
    assert rate(ours, fp32) >= 0.6 * rate(bf16, fp32)
    assert rate(ours, bf16) >= 0.6 * rate(bf16, fp32)


@pytest.mark.parametrize("b_scale", [0.02, 0.15])
def test_bf16_fused_lora_logits_track_fp32_as_closely_as_peft_bf16(tmp_path, b_scale, skinny):  # noqa: F811
    """The fused LoRA path rounds each token's shrunk values x·Aᵀ to bf16 inside the stacked
    [W; A] GEMM, as PEFT's bf16 lora_A does (the Punica shrink keeps fp32 partials). Judged
    against the yardstick users have: the decode-step logits after a fused prefill, ours in
    bf16 and PEFT's in bf16, each against PEFT in fp32 on the same token sequences. B ~ N(0,
    0.02) is a trained adapter's scale, 0.15 the other tests' large one (it makes a projection's
    output ~3x larger, which magnifies any rounding). Session 9 saw the fused prefill 10x
    further from fp32 than shrink + expand at 0.15; the question here is whether it is further
    than PEFT bf16 is."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from benchmarks.step_probe import decoding_batch
    from tests.helpers.models import make_hf_model, save_hf_model
    save_hf_model("llama3_gqa", tmp_path / "base")
    peft = get_peft_model(make_hf_model("llama3_gqa"),
                          LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # A keeps PEFT's default (Kaiming-uniform) init; B gets b_scale
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_scale)
    peft.save_pretrained(str(tmp_path / "ad"))
    engine = Engine.from_config(
        EngineConfig(model=str(tmp_path / "base"), device="cuda", dtype="bfloat16", max_model_len=128,
                     max_num_seqs=8, enable_lora=True, max_loras=1, max_lora_rank=8),
        adapters={"ad": str(tmp_path / "ad")})
    prompts = [torch.randint(3, 200, (6 + 7 * i,), generator=g).tolist() for i in range(8)]
    with decoding_batch(engine, prompts, ["ad"] * 8, graphs=True) as (runner, batch):
        ours = runner.decode(batch).float().clone()
        token_lists = [list(s.token_ids) for s in batch.seqs]

    def peft_logits(dtype):
        m = PeftModel.from_pretrained(make_hf_model("llama3_gqa"), str(tmp_path / "ad"))
        m = m.to("cuda", dtype).eval()
        with torch.no_grad():
            return torch.stack([m(torch.tensor([t], device="cuda")).logits[0, -1].float()
                                for t in token_lists])
    ref, peft_bf16 = peft_logits(torch.float32), peft_logits(torch.bfloat16)
    err = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    print(f"B scale {b_scale}: decode logits rel err vs PEFT fp32: ours bf16 (fused) "
          f"{err(ours):.3e}, PEFT bf16 {err(peft_bf16):.3e}")
    assert err(ours) <= 1.5 * err(peft_bf16) + 1e-3
