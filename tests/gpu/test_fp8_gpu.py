"""FP8 on the GPU: a Llama-3-8B-shaped random model quantized at load time against the same
weights in bf16 and fp32 (first-step logits), graph replay equal to eager, and an FP8
checkpoint's Triton block-scaled path."""
import dataclasses
import gc

import pytest
import torch

from batchrun.bench.presets import PRESETS
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.models.loader import model_from_hf_state
from batchrun.engine.models.quant import on_the_fly_scheme
from batchrun.engine.request import Request
from batchrun.engine.sequence import Sequence

pytestmark = pytest.mark.gpu
# The FP8 engine's first-step logits may be at most this much further (relative L2) from fp32
# than the declared FP8 math itself run in fp32 (layers/fp8.py's CPU path: e4m3 weights per
# channel, activations per token, fp32 sums). FP8 rounds each GEMM's operands to 3 mantissa bits,
# so on a 32-layer random model that math alone is about ten times further from fp32 than bf16; the
# engine adds bf16 activations, whose rounding flips some FP8 roundings, and its kernels'
# accumulation. A wrong scale or a lossy accumulator shows as a multiple, not a fraction.
FP8_EXTRA = 0.25


def _first_logits(engine, prompts):
    sched = engine.scheduler()
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, i, p, SamplingParams(), None, None))
    batch = sched.schedule()
    got = engine.runner.prefill(batch).float()
    for seq in list(sched.running):
        sched.finish(seq, "length")
    return got


def test_fp8_logits_of_a_llama3_8b_shape_against_bf16_and_fp32(monkeypatch):
    import batchrun.engine.layers.fp8 as fp8_layers
    from transformers import LlamaConfig, LlamaForCausalLM
    raw = dict(PRESETS["llama-3-8b"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(LlamaConfig(**raw)).to(torch.bfloat16).eval()
        for p in hf.parameters():
            if p.dim() == 2:
                p.data.normal_(0.0, 0.02)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, raw["vocab_size"], (32,), generator=g).tolist() for _ in range(8)]
    ids = torch.tensor(prompts, device="cuda")
    with torch.no_grad():
        hf_bf16 = hf(ids).logits[:, -1].float()
    fp8_cfg = dataclasses.replace(ModelConfig.from_dict(dict(raw)), quant=on_the_fly_scheme())
    ours = model_from_hf_state(fp8_cfg, hf.state_dict(), torch.device("cuda"), torch.bfloat16, 512)
    with torch.no_grad():
        hf.float()
        ref = hf(ids).logits[:, -1].float()
    hf.cpu()  # its fp32 weights (bf16 values) quantize to the same e4m3 weights below
    torch.cuda.empty_cache()
    assert ours.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    engine = Engine.from_model(EngineConfig(model="llama-3-8b", max_model_len=512, max_num_seqs=8,
                                            quantization="fp8"), ours)
    got = _first_logits(engine, prompts)
    # graphs (decode through the Triton FP8 GEMM at batch <= 16) replay what eager computes
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    graphs = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    eager = Engine.from_model(EngineConfig(model="llama-3-8b", max_model_len=512, max_num_seqs=8,
                                           quantization="fp8", enforce_eager=True), ours)
    same = eager.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    del engine, eager, ours
    gc.collect()  # the engines' KV caches and graphs, before a third engine sizes its own
    torch.cuda.empty_cache()
    # the declared FP8 math in fp32 on the GPU: the same e4m3 weights, every FP8 Linear through
    # the reference (fp32 activations quantized per token, fp32 sums)
    ours32 = model_from_hf_state(fp8_cfg, hf.state_dict(), torch.device("cuda"), torch.float32, 512)
    del hf
    monkeypatch.setattr(fp8_layers, "use_triton", lambda x: False)
    ref_engine = Engine.from_model(EngineConfig(model="llama-3-8b", max_model_len=512, max_num_seqs=8,
                                                quantization="fp8", enforce_eager=True), ours32)
    fp8_math = _first_logits(ref_engine, prompts)
    err = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    print(f"first-step logits rel err vs fp32: FP8 engine {err(got):.3e}, FP8 math in fp32 "
          f"{err(fp8_math):.3e}, HF bf16 {err(hf_bf16):.3e}; FP8 engine vs FP8 math "
          f"{((got - fp8_math).norm() / fp8_math.norm()).item():.3e}")
    assert err(got) <= (1 + FP8_EXTRA) * err(fp8_math)
    assert [r.output_token_ids for r in graphs] == [r.output_token_ids for r in same]


@pytest.mark.parametrize("scheme", ["hf_block", "ct_tensor_static", "ct_channel_token"])
def test_fp8_checkpoints_run_on_the_gpu_close_to_their_cpu_math(tmp_path, scheme):
    from tests.helpers.fp8 import save_fp8_checkpoint
    from tests.helpers.models import make_hf_model, random_prompts
    hf = make_hf_model("llama3_gqa", hidden_size=128, intermediate_size=256, num_attention_heads=4)
    save_fp8_checkpoint(hf, tmp_path / "m", scheme)
    prompts = random_prompts(4, [5, 40, 70, 9], hf.config.vocab_size, seed=3)
    logits = {}
    for device, dtype in (("cpu", "float32"), ("cpu", "bfloat16"), ("cuda", "bfloat16")):
        engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device=device,
                                                 dtype=dtype, max_model_len=256, max_num_seqs=4))
        logits[device, dtype] = _first_logits(engine, prompts).cpu()
    ref = logits["cpu", "float32"]
    err = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    # the yardstick: the declared math itself with bf16 activations (the CPU path in bf16), whose
    # roundings flip some FP8 roundings of the activations as the GPU's do
    gpu, cpu_bf16 = err(logits["cuda", "bfloat16"]), err(logits["cpu", "bfloat16"])
    print(f"{scheme}: logits rel err vs the fp32 CPU math: bf16 GPU {gpu:.3e}, bf16 CPU {cpu_bf16:.3e}")
    assert gpu <= 1.5 * cpu_bf16 + 1e-2


def test_the_trained_demo_model_gives_the_same_text_in_fp8_as_in_bf16_on_the_gpu():
    # demo/: base copies the prompt, `reverse` reverses it, `upper` upper-cases it (trained).
    # bf16, FP8 weights (on the fly), FP8 weights + an FP8 KV cache, and an FP8 KV cache alone,
    # with graphs (decode through the FP8 GEMMs' decode path and the e4m3 cache's kernels).
    # Each gives on the GPU exactly the text the same declared math gives on the CPU in bf16, and
    # FP8 weights the text of bf16. The e4m3 cache's 3 mantissa bits move one of the 12 rows off
    # the bf16 text, on the CPU as on the GPU ('sretpada arol' -> 'sretpada arao').
    from pathlib import Path

    import batchrun
    demo = Path(__file__).resolve().parents[2] / "demo"
    prompts = ["hello world", "batch inference", "lora adapters", "abc def"]
    sp = batchrun.SamplingParams(max_tokens=40, temperature=0.0)
    settings = ((None, "auto"), ("fp8", "auto"), ("fp8", "fp8"), (None, "fp8"))
    texts = {}
    for device in ("cuda", "cpu"):
        for quantization, kv in settings:
            llm = batchrun.LLM(str(demo / "model"),
                               adapters={a: str(demo / "adapters" / a) for a in ("reverse", "upper")},
                               device=device, dtype="bfloat16", max_model_len=128,
                               quantization=quantization, kv_cache_dtype=kv)
            texts[device, quantization, kv] = [o.outputs[0].text for a in (None, "reverse", "upper")
                                               for o in llm.generate(prompts, sp, lora_request=a,
                                                                     use_tqdm=False)]
            del llm
            torch.cuda.empty_cache()
    for quantization, kv in settings:
        assert texts["cuda", quantization, kv] == texts["cpu", quantization, kv], (quantization, kv)
    bf16 = texts["cuda", None, "auto"]
    assert bf16 == prompts + [p[::-1] for p in prompts] + [p.upper() for p in prompts]
    assert texts["cuda", "fp8", "auto"] == bf16
    for kv_setting in (("fp8", "fp8"), (None, "fp8")):
        differ = [(a, b) for a, b in zip(bf16, texts[("cuda",) + kv_setting]) if a != b]
        print(kv_setting, "rows off the bf16 text:", differ)
        assert len(differ) <= 1
