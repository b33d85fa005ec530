"""FP8 on the GPU: a Llama-3-8B-shaped random model quantized at load time against the same
weights in bf16 and fp32 (first-step logits), graph replay equal to eager, and an FP8
checkpoint's Triton block-scaled path."""
import dataclasses

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
# first-step logits, relative L2 error against fp32 of the same weights: FP8 (e4m3 weights per
# channel, activations per token) rounds each GEMM's operands to 3 mantissa bits, bf16 to 8
FP8_LOGITS_TOL = 0.10


def _first_logits(engine, prompts):
    sched = engine.scheduler()
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, i, p, SamplingParams(), None, None))
    batch = sched.schedule()
    got = engine.runner.prefill(batch).float()
    for seq in list(sched.running):
        sched.finish(seq, "length")
    return got


def test_fp8_logits_of_a_llama3_8b_shape_against_bf16_and_fp32():
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
    cfg = ModelConfig.from_dict(dict(raw))
    fp8_cfg = dataclasses.replace(cfg, quant=on_the_fly_scheme())
    ours = model_from_hf_state(fp8_cfg, hf.state_dict(), torch.device("cuda"), torch.bfloat16, 512)
    with torch.no_grad():
        hf.float()
        ref = hf(ids).logits[:, -1].float()
    del hf
    torch.cuda.empty_cache()
    assert ours.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    engine = Engine.from_model(EngineConfig(model="llama-3-8b", max_model_len=512, max_num_seqs=8,
                                            quantization="fp8"), ours)
    got = _first_logits(engine, prompts)
    err = lambda x: ((x - ref).norm() / ref.norm()).item()  # noqa: E731
    print(f"first-step logits rel err vs fp32: FP8 {err(got):.3e}, bf16 {err(hf_bf16):.3e}")
    assert err(got) <= FP8_LOGITS_TOL
    # graphs (decode through the Triton FP8 GEMM at batch <= 16) replay what eager computes
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    graphs = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    eager = Engine.from_model(EngineConfig(model="llama-3-8b", max_model_len=512, max_num_seqs=8,
                                           quantization="fp8", enforce_eager=True), ours)
    same = eager.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    assert [r.output_token_ids for r in graphs] == [r.output_token_ids for r in same]


@pytest.mark.parametrize("scheme", ["hf_block", "ct_tensor_static", "ct_channel_token"])
def test_fp8_checkpoints_run_on_the_gpu_close_to_their_cpu_math(tmp_path, scheme):
    from tests.helpers.fp8 import save_fp8_checkpoint
    from tests.helpers.models import make_hf_model, random_prompts
    hf = make_hf_model("llama3_gqa", hidden_size=128, intermediate_size=256, num_attention_heads=4)
    save_fp8_checkpoint(hf, tmp_path / "m", scheme)
    prompts = random_prompts(4, [5, 40, 70, 9], hf.config.vocab_size, seed=3)
    logits = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        engine = Engine.from_config(EngineConfig(model=str(tmp_path / "m"), device=device,
                                                 dtype=dtype, max_model_len=256, max_num_seqs=4))
        logits[device] = _first_logits(engine, prompts).cpu()
    ref = logits["cpu"]
    err = ((logits["cuda"] - ref).norm() / ref.norm()).item()
    print(f"{scheme}: bf16 GPU vs fp32 CPU logits rel err {err:.3e}")
    assert err < 0.05


def test_the_trained_demo_model_gives_the_same_text_in_fp8_as_in_bf16_on_the_gpu():
    # demo/: base copies the prompt, `reverse` reverses it, `upper` upper-cases it (trained).
    # bf16 on the GPU, then FP8 weights (on the fly), then FP8 weights + an FP8 KV cache: the
    # same text for base and adapter rows, with graphs (decode through the FP8 GEMMs' decode
    # path and the e4m3 cache's kernels).
    from pathlib import Path

    import batchrun
    demo = Path(__file__).resolve().parents[2] / "demo"
    prompts = ["hello world", "batch inference", "lora adapters", "abc def"]
    sp = batchrun.SamplingParams(max_tokens=40, temperature=0.0)
    texts = {}
    for quantization, kv in ((None, "auto"), ("fp8", "auto"), ("fp8", "fp8")):
        llm = batchrun.LLM(str(demo / "model"),
                           adapters={a: str(demo / "adapters" / a) for a in ("reverse", "upper")},
                           device="cuda", dtype="bfloat16", max_model_len=128,
                           quantization=quantization, kv_cache_dtype=kv)
        texts[quantization, kv] = {a: [o.outputs[0].text for o in llm.generate(
            prompts, sp, lora_request=a, use_tqdm=False)] for a in (None, "reverse", "upper")}
        del llm
        torch.cuda.empty_cache()
    want = {None: prompts, "reverse": [p[::-1] for p in prompts], "upper": [p.upper() for p in prompts]}
    assert texts[None, "auto"] == want
    assert texts["fp8", "auto"] == want
    assert texts["fp8", "fp8"] == want
