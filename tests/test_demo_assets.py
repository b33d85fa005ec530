"""The shipped demo assets (demo/) behave as documented, checked with HF transformers + PEFT.

base copies the prompt, adapter `reverse` reverses it, adapter `upper` upper-cases it, under
greedy decoding. Regenerate the assets with `python scripts/train_demo.py` if these fail.
The end-to-end test through batchrun's own engine lives elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

DEMO = Path(__file__).resolve().parent.parent / "demo"
MODEL = DEMO / "model"
ADAPTERS = {name: DEMO / "adapters" / name for name in ("reverse", "upper")}
PROMPTS = ["hello world", "batch run", "lora adapters", "abc def", "the quick fox", "xyz"]
EXPECTED = {
    "base": lambda s: s,
    "reverse": lambda s: s[::-1],
    "upper": lambda s: s.upper(),
}


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, ADAPTERS["reverse"], adapter_name="reverse")
    pm.load_adapter(ADAPTERS["upper"], adapter_name="upper")
    pm.eval()
    return pm


def test_files_are_safetensors_and_small():
    files = [f for f in DEMO.rglob("*") if f.is_file()]
    assert not [f for f in files if f.suffix in (".bin", ".pt", ".pth", ".pkl")]
    assert (MODEL / "model.safetensors").is_file()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (MODEL / name).is_file(), name
    for path in ADAPTERS.values():
        assert (path / "adapter_model.safetensors").is_file()
        assert (path / "adapter_config.json").is_file()
    assert sum(f.stat().st_size for f in files) < 10 * 1024 * 1024


def test_prompt_format(tokenizer):
    # The plain prompt text is the model input: <s> + one token per character + <sep>.
    ids = tokenizer("hello world")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 1
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<sep>") == 4
    assert len(ids) == len("hello world") + 2
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 2, 3)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
    # No cleanup of spaces around punctuation: decoding is exact.
    assert tokenizer.decode(tokenizer("a . b")["input_ids"], skip_special_tokens=True) == "a . b"


def test_prompts_parquet():
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(DEMO / "data" / "prompts.parquet")
    assert table.column_names == ["id", "prompt", "adapter"]
    rows = table.to_pylist()
    assert len({r["id"] for r in rows}) == len(rows)
    assert {r["adapter"] for r in rows} == {None, "reverse", "upper"}
    # Some prompt text appears under all three so the difference is visible.
    by_text: dict[str, set] = {}
    for r in rows:
        by_text.setdefault(r["prompt"], set()).add(r["adapter"])
    assert any(v == {None, "reverse", "upper"} for v in by_text.values())


def _greedy(model, tokenizer, prompt: str) -> str:
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=len(prompt) + 2,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    assert new[-1] == tokenizer.eos_token_id, f"no </s> for {prompt!r}: {new}"
    return tokenizer.decode(new, skip_special_tokens=True)


@pytest.mark.parametrize("task", ["base", "reverse", "upper"])
def test_greedy_outputs(model, tokenizer, task):
    for prompt in PROMPTS:
        if task == "base":
            with model.disable_adapter():
                got = _greedy(model, tokenizer, prompt)
        else:
            model.set_adapter(task)
            got = _greedy(model, tokenizer, prompt)
        assert got == EXPECTED[task](prompt), (task, prompt, got)


@pytest.mark.slow
def test_the_trained_demo_model_gives_the_same_text_in_fp8():
    # FP8 weights (on the fly) and an FP8 KV cache: every row the trained model gets right in
    # the model dtype comes out the same (rows it gets wrong drift, as any rounding change may)
    import batchrun
    prompts = ["hello world", "batch inference", "lora adapters"]
    want = {None: prompts, "upper": [p.upper() for p in prompts], "reverse": [p[::-1] for p in prompts]}
    sp = batchrun.SamplingParams(max_tokens=40, temperature=0.0)
    for quantization, kv in ((None, "auto"), ("fp8", "auto"), ("fp8", "fp8")):
        llm = batchrun.LLM(str(MODEL), adapters={k: str(v) for k, v in ADAPTERS.items()},
                           device="cpu", max_model_len=128, quantization=quantization,
                           kv_cache_dtype=kv)
        for adapter, texts in want.items():
            outs = llm.generate(prompts, sp, lora_request=adapter, use_tqdm=False)
            assert [o.outputs[0].text for o in outs] == texts, (quantization, kv, adapter)
