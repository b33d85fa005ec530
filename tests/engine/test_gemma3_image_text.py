"""A Gemma 3 image-text checkpoint (Gemma3ForConditionalGeneration): batchrun runs its text tower
on text prompts, with greedy tokens equal to transformers' model given the same text; the vision
tower's tensors are not loaded, and an adapter on the vision tower is refused by name."""
import json

import pytest
import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine
from batchrun.engine.lora.adapters import inspect_adapter
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.request import Request
from batchrun.errors import AdapterError
from tests.helpers.models import hf_config, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def image_text(tmp_path_factory):
    import transformers
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    cfg = transformers.Gemma3Config(text_config=hf_config("gemma3").to_dict(),
                                    vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                    tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp("gemma3") / "m"
    model.save_pretrained(str(path))
    return model, path


def test_text_tower_matches_transformers(image_text):
    model, path = image_text
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert ModelConfig.from_dir(path).model_type == "gemma3_text"
    prompts = random_prompts(4, [5, 70, 20, 120], 211, seed=1)
    engine = Engine.from_config(EngineConfig(model=str(path), device="cpu", max_model_len=256))
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    results = engine.generate([Request(i, p, sp) for i, p in enumerate(prompts)])
    outs = [r.output_token_ids for r in results]
    assert outs == [hf_greedy(model, p, 16) for p in prompts]
    assert len({t for o in outs for t in o}) > 8  # informative tokens, not one repeated


def _fresh(path):
    import transformers
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(path), attn_implementation="eager")
    return model.float().eval()


def test_vision_tower_adapter_is_refused(image_text, tmp_path):
    from peft import LoraConfig, get_peft_model
    _, path = image_text
    peft = get_peft_model(_fresh(path), LoraConfig(r=2, target_modules=["q_proj", "out_proj"],
                                            init_lora_weights=False))
    peft.save_pretrained(str(tmp_path / "a"))
    with pytest.raises(AdapterError, match="vision tower"):
        inspect_adapter("a", tmp_path / "a", ModelConfig.from_dir(path), max_lora_rank=8)


def test_text_tower_adapter_runs_as_peft(image_text, tmp_path):
    from peft import LoraConfig, get_peft_model
    _, path = image_text
    peft = get_peft_model(_fresh(path), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                            target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    peft.save_pretrained(str(tmp_path / "a"))
    info = inspect_adapter("a", tmp_path / "a", ModelConfig.from_dir(path), max_lora_rank=8)
    assert len(info.targets) == 2 * 3
    engine = Engine.from_config(EngineConfig(model=str(path), device="cpu", max_model_len=256,
                                             enable_lora=True, max_lora_rank=8),
                                adapters={"a": str(tmp_path / "a")})
    prompts = random_prompts(2, [9, 40], 211, seed=2)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    got = [r.output_token_ids for r in engine.generate([Request(i, p, sp, adapter="a")
                                                        for i, p in enumerate(prompts)])]
    assert got == [hf_greedy(peft.eval(), p, 8) for p in prompts]
    with peft.disable_adapter():  # the adapter changes the tokens
        assert got != [hf_greedy(peft, p, 8) for p in prompts]
