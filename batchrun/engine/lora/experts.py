"""LoRA on a mixture-of-experts block: the router and the stacked experts, as PEFT (0.21, on
transformers 5's fused expert tensors) saves it with `target_parameters`.

PEFT wraps a parameter, not a Linear: `mlp.gate.weight` (the router, [E, H]) gets an ordinary
lora_A [r, H] / lora_B [E, r]; a stacked expert tensor [E, out, in] gets lora_A [E*r, in] and
lora_B [out, r*E] whose expert e is A rows e*r..e*r+r-1 and B columns j*E + e (PEFT's
ParamWrapper.get_delta_weight: delta_e = scaling * B_e @ A_e). Several wrapped parameters of one
module nest (`mlp.experts.lora_A`, `mlp.experts.base_layer.lora_A`, ...), so which tensor the
weights belong to is read from their shapes: gate_up_proj's A is [E*r, H] and its B [2I, E*r],
down_proj's A [E*r, I] and its B [H, E*r] (I = H would need 2I = H too, which cannot be).

Adapters trained on transformers 4's per-expert Linears (mlp.experts.3.gate_proj) are refused:
PEFT converts them when it loads them into transformers 5, and saving that PeftModel again
writes the layout above.

This module is torch-free (adapter validation runs in `plan`). The engine keeps each targeted
tensor's slots stacked as `expert_layer.ExpertLoRA` buffers A [slots, E, R,
in], B [slots, E, out, R] (the router: E = 1), scaling folded into B; layers/moe.py applies
them per (token, expert) in torch. The GPU's fused MoE kernel does not take them yet, so an
engine on CUDA refuses such adapters (manager.py).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from batchrun.engine.lora.peft_config import adapter_error, check_rank

if TYPE_CHECKING:  # validation runs without torch (`plan`); only loading needs it
    from torch import Tensor

# the block's LoRA targets: our module names (AdapterInfo.modules, SparseMoE.lora keys) -> what
# PEFT targets
ROUTER, GATE_UP, DOWN = "router", "experts_gate_up", "experts_down"
EXPERT_MODULES = {ROUTER: "mlp.gate.weight", GATE_UP: "mlp.experts.gate_up_proj",
                  DOWN: "mlp.experts.down_proj"}
KEY = re.compile(r"^base_model\.model\.model\.layers\.(?P<layer>\d+)\.mlp\."
                 r"(?P<module>gate|experts)(?:\.base_layer)*\.lora_(?P<ab>[AB])\.weight$")
PER_EXPERT = re.compile(r"^base_model\.model\.model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.")


def is_expert_key(key: str) -> bool:
    return KEY.match(key) is not None or PER_EXPERT.match(key) is not None


def expert_targets(name: str, path: Path, cfg, pc, header: dict[str, list[int]],
                   stored: dict[str, str], max_lora_rank: int) -> list:
    """The LoRATargets of the expert-block keys of `header` (is_expert_key), validated against
    the base `cfg` and adapter_config.json `pc`."""
    from batchrun.engine.lora.adapters import LoRATarget
    keys = [k for k in header if is_expert_key(k)]
    if not keys:
        return []
    per_expert = next((k for k in keys if PER_EXPERT.match(k)), None)
    if per_expert is not None:
        raise adapter_error(name, path, f"tensor {per_expert!r} is LoRA on one expert's Linear, "
                            "as transformers 4 built MoE models; transformers 5 stacks the experts, "
                            "so load the adapter with peft on transformers 5 (which converts it) "
                            "and save_pretrained it again")
    e = cfg.experts
    if e is None:
        raise adapter_error(name, path, f"tensor {keys[0]!r} is LoRA on a mixture-of-experts "
                            f"block, but the base is a dense {cfg.model_type} model")
    h, i, n = cfg.hidden_size, e.intermediate_size, e.num_experts
    # (A in, B out) of each target, per expert
    shapes = {ROUTER: (h, n), GATE_UP: (h, 2 * i), DOWN: (i, h)}
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in sorted(keys):
        m = KEY.match(key)
        layer = int(m.group("layer"))
        where = f"model.layers.{layer}.mlp.{m.group('module')}"
        if layer >= cfg.num_hidden_layers or not cfg.is_moe_layer(layer):
            raise adapter_error(name, path, f"tensor {key!r} is LoRA on {where}, but layer "
                                f"{layer} of the base has no expert block")
        found.setdefault((layer, key.replace("lora_A", "lora_?").replace("lora_B", "lora_?")),
                         {})[m.group("ab")] = key
    targets = []
    for (layer, _), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise adapter_error(name, path, f"{next(iter(ab.values()))!r} has no lora_"
                                f"{'B' if 'A' in ab else 'A'} beside it; the weights file is incomplete")
        (ra, ka), (ob, rb) = header[ab["A"]], header[ab["B"]]
        router = ".mlp.gate." in ab["A"]
        experts = 1 if router else n
        module = ROUTER if router else next(
            (mod for mod in (GATE_UP, DOWN) if (ka, ob) == shapes[mod]), None)
        if module is None or (ka, ob) != shapes[module] or ra != rb or ra % experts:
            raise adapter_error(name, path, f"{ab['A']!r} {[ra, ka]} and its lora_B {[ob, rb]} "
                                f"fit none of layer {layer}'s expert tensors (router [E={n}, "
                                f"H={h}], gate_up_proj [E, 2I={2 * i}, H], down_proj [E, H, "
                                f"I={i}]): the adapter was made for a different base model")
        rank = ra // experts
        pkey = f"model.layers.{layer}.{EXPERT_MODULES[module]}"
        check_rank(name, path, pkey, rank, pc, max_lora_rank)
        targets.append(LoRATarget(layer, EXPERT_MODULES[module], module, 0, rank,
                                  pc.scaling_for(pkey, rank), stored[ab["A"]], stored[ab["B"]]))
    return targets


def per_expert(a: Tensor, b: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """PEFT's lora_A [E*r, in] and lora_B [out, r*E] -> A [E, r, in], B [E, out, r]."""
    experts = a.shape[0] // rank
    return (a.view(experts, rank, a.shape[1]),
            b.view(b.shape[0], rank, experts).permute(2, 0, 1))
