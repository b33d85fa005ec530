"""Piecewise prefill graphs (engine/prefill_graphs.py): which steps replay them, and, on CPU,
that the padded static-input forward they capture, with each layer's attention run between
the pieces on the step's own metadata, gives the eager prefill's results.

CPU runs the GPU code path (every Triton kernel under the interpreter, BATCHRUN_FORCE_TRITON)
with the pieces run eagerly instead of replayed: the capture itself needs CUDA
(tests/gpu/test_prefill_graphs_gpu.py)."""
import pytest

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.envs import Experiments
from batchrun.engine.cudagraph_dispatcher import CudaGraphs, token_buckets
from batchrun.engine.prefill_graphs import PrefillGraphs
from batchrun.engine.request import Request
from tests.helpers.models import random_prompts, save_hf_model


class EagerPieces(PrefillGraphs):
    """A PrefillGraphs whose replay runs the forward it would capture eagerly
    (PrefillGraphs.run_eager: the same split, each attention on the step's metadata), the
    attention output NaN first so that a row no sequence owns cannot be read unnoticed.
    Records the keys it ran."""

    def __init__(self, runner):
        super().__init__(token_buckets(runner._prefill_tokens), runner.model.attention_layers(),
                         runner._p_q, runner._p_out)
        self.forward, self.lora_steps, self.keys = runner.prefill_forward, runner._prefill_lora, []

    def replay(self, key, meta):
        self.keys.append(key)
        self.out.fill_(float("nan"))
        step_lora = self.lora_steps[key.lora_slots] if key.lora_slots else None
        return self.run_eager(self.forward, key, meta, step_lora)


def tiny_model_and_adapters(tmp_path, lora: bool):
    """A tiny Llama (GQA) in tmp_path/base and, with lora, two real PEFT adapters of it (q/v
    only, all linear layers): (the HF model, {adapter name: dir})."""
    from tests.helpers.adapters import ADAPTERS, parity_adapter
    base = save_hf_model("llama3_gqa", tmp_path / "base")
    adapters = {}
    for i, name in enumerate(("qv", "all") if lora else ()):
        parity_adapter("llama3_gqa", tmp_path / name, 100 + i, ADAPTERS[name])
        adapters[name] = str(tmp_path / name)
    return base, adapters


def _engine(tmp_path, adapters, **kw):
    cfg = EngineConfig(model=str(tmp_path / "base"), device="cpu", max_model_len=128,
                       max_num_batched_tokens=48, enable_lora=bool(adapters), max_loras=2,
                       max_lora_rank=8, **kw)
    return Engine.from_config(cfg, adapters or None)


@pytest.mark.slow  # two whole engines with interpreted kernels
@pytest.mark.parametrize("lora", [False, True])
def test_piecewise_prefill_matches_eager(tmp_path, monkeypatch, lora):
    pytest.importorskip("triton")
    import batchrun.engine.model_runner as model_runner
    monkeypatch.setattr(model_runner, "use_triton", lambda t: True)
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", "1")
    base, adapters = tiny_model_and_adapters(tmp_path, lora)
    # lengths around the buckets (16, 32, 48: the cap is max_num_batched_tokens), prompts
    # longer than a step (chunked: a chunk attends to the cached chunks before it) and a
    # shared 20-token prefix (the second pass reuses its cached block)
    prompts = random_prompts(6, [5, 17, 40, 3, 29, 70], base.config.vocab_size, seed=4)
    prompts += [prompts[2][:20] + p for p in random_prompts(3, [4, 9, 31], base.config.vocab_size, 5)]
    names = [None, "qv", "all"] if lora else [None]
    # two tokens: the first from the prefill, the second from a decode step reading its K/V
    sp = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=3)
    reqs = [Request(i, p, sp, adapter=names[i % len(names)]) for i, p in enumerate(prompts)]

    # then base rows only: a LoRA engine's steps without adapter tokens take the no-LoRA set
    base_reqs = [Request(100 + i, p, sp) for i, p in enumerate(prompts[:4])]

    eager = _engine(tmp_path, adapters)
    want = eager.generate(reqs) + eager.generate(base_reqs)
    pieces_engine = _engine(tmp_path, adapters)
    runner = pieces_engine.runner
    assert runner._prefill_tokens == 48
    pieces = EagerPieces(runner)
    runner._graphs = CudaGraphs(runner.lora is not None, decode=None, prefill=pieces)
    got = pieces_engine.generate(reqs) + pieces_engine.generate(base_reqs)
    keys = pieces.keys
    assert keys and all(k.tokens in (16, 32, 48) and not k.decode_only for k in keys)
    assert {k.lora_slots > 0 for k in keys} == ({False, True} if lora else {False})
    for a, b in zip(want, got):
        assert a.output_token_ids == b.output_token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        for x, y in zip(a.top_logprobs, b.top_logprobs):
            assert [t for t, _ in x] == [t for t, _ in y]
            assert [p for _, p in x] == pytest.approx([p for _, p in y], abs=1e-4)


def test_off_when_eager_or_zero(tmp_path):
    save_hf_model("llama3_gqa", tmp_path / "base")
    assert _engine(tmp_path, {}, enforce_eager=True).runner._prefill_tokens == 0
    for n in (0, 16):
        engine = _engine(tmp_path, {}, experiments=Experiments(prefill_graph_max_tokens=n))
        assert engine.runner._prefill_tokens == n
    runner = _engine(tmp_path, {}).runner
    assert runner.prefill_graphs is None  # CPU: nothing captured, every prefill eager
