"""PEFT LoRA adapters of the tiny models (tests.helpers.models), the dense deltas PEFT computes
for them, and a stand-in for batchrun's model tree for the LoRA loading tests."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tests.helpers.models import make_hf_model

# the adapter kinds of the engine-vs-PEFT parity tests: ranks, alphas, rsLoRA, per-module
# rank/alpha patterns, one-layer adapters, regex targets
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
    "mlp1": dict(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj", "k_proj"],
                 rank_pattern={"down_proj": 6}, alpha_pattern={"k_proj": 12}, layers_to_transform=[1]),
    "o": dict(r=2, lora_alpha=8, target_modules=["o_proj"]),
    "qkv": dict(r=8, lora_alpha=4, target_modules=r".*\.(q|k|v)_proj"),
}


def make_adapter(path, variant: str = "lora_llama", seed: int = 0, lora_std: float | None = None,
                 base_over: dict | None = None, save_kwargs: dict | None = None, **lora_kwargs):
    """Save a PEFT LoRA adapter with non-zero A and B (``init_lora_weights=False``) of the tiny
    ``variant`` (config fields ``base_over``) to ``path``; returns the PeftModel.

    ``lora_std=None``: PEFT's random init, torch seeded with ``seed`` before the base is built.
    ``lora_std=s``: every A and B drawn N(0, s) from a generator seeded ``seed`` (deltas big enough
    to change greedy tokens, small enough to stay sane), on the variant's seed-0 base.
    ``lora_kwargs``: LoraConfig fields (target_modules defaults to q_proj and v_proj)."""
    from peft import LoraConfig, get_peft_model
    lora_kwargs.setdefault("target_modules", ["q_proj", "v_proj"])
    base = make_hf_model(variant, seed if lora_std is None else 0, **(base_over or {}))
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    if lora_std is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * lora_std)
    model.save_pretrained(str(path), **(save_kwargs or {}))
    return model


def save_peft_adapters(root: Path, names: list[str], variant: str = "llama3_gqa", seed: int = 0,
                       rank: int = 4, targets=("q_proj", "v_proj"), scale: float = 0.15) -> dict[str, str]:
    """Adapters ``names`` (make_adapter with lora_std ``scale``, seeds seed, seed+1, ...) saved
    under root/<name>. Returns {name: path}."""
    adapters = {}
    for i, name in enumerate(names):
        make_adapter(root / name, variant, seed + i, lora_std=scale, r=rank, lora_alpha=2 * rank,
                     target_modules=list(targets))
        adapters[name] = str(root / name)
    return adapters


def peft_deltas(peft_model) -> dict:
    """(layer, peft module) -> dense delta weight [out, in] (peft's own get_delta_weight)."""
    from peft.tuners.lora import LoraLayer
    out = {}
    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLayer) and "default" in mod.lora_A:
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            out[(layer, parts[-1])] = mod.get_delta_weight("default").detach().float()
    return out


class FakeLlama(nn.Module):
    """The module tree of batchrun's LlamaForCausalLM (just the Linears, random weights), for the
    LoRA manager and layer tests that need no forward pass."""

    def __init__(self, cfg, dtype=torch.float32, seed: int = 0):
        from batchrun.engine.layers.linear import Linear
        super().__init__()
        self.config = cfg
        g = torch.Generator().manual_seed(seed)
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            layer = nn.Module()
            layer.self_attn, layer.mlp = nn.Module(), nn.Module()
            layer.self_attn.qkv_proj = Linear(H, [q, kv, kv], name="qkv_proj")
            layer.self_attn.o_proj = Linear(q, [H], name="o_proj")
            layer.mlp.gate_up_proj = Linear(H, [I, I], name="gate_up_proj")
            layer.mlp.down_proj = Linear(I, [H], name="down_proj")
            self.model.layers.append(layer)
        for p in self.parameters():
            p.data = (torch.randn(p.shape, generator=g) * 0.1).to(dtype)


def parity_adapter(variant: str, path, seed: int, kw: dict):
    """The engine-parity tests' adapter: LoraConfig ``kw`` (e.g. an ADAPTERS entry) of ``variant``,
    A and B drawn N(0, 0.15) from ``seed``."""
    return make_adapter(path, variant, seed, lora_std=0.15, **kw)


def assert_results_match_peft(variant: str, base, paths: dict, prompts, names, results, new: int) -> None:
    """Each engine result (row i ran adapter names[i], None = base) equals transformers + peft's
    greedy tokens for its prompt, and every adapter in `paths` changes some row's tokens (so the
    comparison could fail). base: the HF base model; paths: adapter name -> directory."""
    from peft import PeftModel
    from tests.helpers.models import hf_greedy
    refs = {None: base}
    for name, adapter_dir in paths.items():
        refs[name] = PeftModel.from_pretrained(make_hf_model(variant), str(adapter_dir)).eval()
    changed = set()
    for p, n, r in zip(prompts, names, results):
        assert r.finish_reason == "length", r.error
        want = hf_greedy(refs[n], p, new)
        assert r.output_token_ids == want, f"adapter {n}, prompt len {len(p)}"
        if n is not None and n not in changed and want != hf_greedy(base, p, new):
            changed.add(n)
    assert changed == set(paths)  # each adapter really changes some output


def check_mixed_with_peft(tmp_path, variant: str, adapters, device: str = "cpu", seed: int = 300,
                          new: int = 8) -> None:
    """The engine on ``device`` (fp32) against transformers + peft (CPU): base rows and two
    adapters mixed in one generate. adapters: name -> LoraConfig fields (two of them), or a
    function of the saved HF base model giving that; adapter i is drawn from ``seed + i``."""
    from batchrun.engine.config import EngineConfig, SamplingParams
    from batchrun.engine.engine import Engine
    from batchrun.engine.request import Request
    from tests.helpers.models import random_prompts, save_hf_model
    base = save_hf_model(variant, tmp_path / "base")
    if callable(adapters):
        adapters = adapters(base)
    paths = {}
    for i, (name, kw) in enumerate(adapters.items()):
        paths[name] = tmp_path / name
        parity_adapter(variant, paths[name], seed + i, kw)
    first, second = list(adapters)
    names = [None, first, second, None, first, second, first]
    # prompts longer than the test models' windows (48) and LongRoPE's pretraining length (64)
    prompts = random_prompts(len(names), [5, 70, 17, 90, 3], base.config.vocab_size, seed=4)
    engine = Engine.from_config(
        EngineConfig(model=str(tmp_path / "base"), device=device, dtype="float32", max_model_len=256,
                     max_num_batched_tokens=64, enable_lora=True, max_loras=2, max_lora_rank=8),
        adapters={n: str(p) for n, p in paths.items()})
    sp = SamplingParams(max_tokens=new, ignore_eos=True)
    results = engine.generate([Request(i, p, sp, adapter=n)
                               for i, (p, n) in enumerate(zip(prompts, names))])
    assert_results_match_peft(variant, base, paths, prompts, names, results, new)
