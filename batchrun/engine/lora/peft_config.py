"""adapter_config.json of a PEFT LoRA adapter: parse, refuse what batchrun cannot run, and
answer "which module gets which rank and alpha" with peft's own matching rules.

The matching copies peft 0.21 (`check_target_module_exists`, `get_pattern_key`) so that the
modules we expect are exactly those peft would have wrapped when the adapter was trained. Keys are
module names of a transformers `*ForCausalLM`: "model.layers.3.self_attn.q_proj".
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from batchrun.errors import AdapterError

# peft module name -> (parent in the decoder layer, our fused Linear, slice index)
PEFT_MODULES: dict[str, tuple[str, str, int | None]] = {
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
# Phi-3's Linears are fused in the model itself, so its adapters target qkv_proj and
# gate_up_proj whole (slice None: one A for all slices, B's rows split by slice)
FUSED_PEFT_MODULES: dict[str, tuple[str, str, int | None]] = {
    "qkv_proj": ("self_attn", "qkv_proj", None),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_up_proj": ("mlp", "gate_up_proj", None),
    "down_proj": ("mlp", "down_proj", 0),
}
EMBEDDING_MODULES = ("model.embed_tokens", "lm_head")


def peft_modules(model_config) -> dict[str, tuple[str, str, int | None]]:
    """The Linear modules of the base model's transformers class, as peft names them."""
    return FUSED_PEFT_MODULES if getattr(model_config, "fused_checkpoint", False) else PEFT_MODULES


def module_key(layer: int, peft_module: str) -> str:
    parent = (PEFT_MODULES.get(peft_module) or FUSED_PEFT_MODULES[peft_module])[0]
    return f"model.layers.{layer}.{parent}.{peft_module}"


def check_rank(name: str, path, key: str, rank: int, pc: "PeftLoraConfig",
               max_lora_rank: int) -> None:
    """A module's stored rank agrees with adapter_config.json (r / rank_pattern) and fits
    engine.max_lora_rank; key: the module's name as the config patterns see it."""
    expected = pc.rank_for(key)
    if rank != expected:
        raise adapter_error(name, path, f"{key} has rank {rank} but adapter_config.json "
                            f"r/rank_pattern give {expected}; the config does not belong to "
                            "these weights")
    if rank > max_lora_rank:
        raise adapter_error(name, path, f"{key} has rank {rank}, above max_lora_rank="
                            f"{max_lora_rank}; raise engine.max_lora_rank to at least {rank}")


def adapter_error(name: str, path, msg: str) -> AdapterError:
    return AdapterError(f"LoRA adapter {name!r} ({path}): {msg}")


# Config fields batchrun refuses when set (truthy, or not "none" for bias): the fix for each.
# peft's LoRA variants (LoraConfig fields that pick a LoraVariant, peft 0.21) are named, so a
# refused adapter says which variant it is rather than failing later on a tensor shape or name.
_MERGE = "merge the adapter into the base model (peft's merge_and_unload) and run the merged model"
_REFUSED = {
    "use_dora": "DoRA adapters are not supported; merge the DoRA adapter into the base model "
                "or retrain with use_dora=false",
    "kasa_config": "KaSA adapters are not supported: KaSA truncates the base weights' smallest singular "
                   "components and scales the update by a learned diagonal (lora_diag), so it does not run "
                   f"on the unmodified base model; {_MERGE}",
    "use_bdlora": "BD-LoRA adapters are not supported: their block-diagonal LoRA factors are stored "
                  f"compressed (fewer columns than the base layer); {_MERGE}, or retrain as plain LoRA",
    "arrow_config": "Arrow adapters (routing between several LoRA experts per token) are not supported; "
                    "run each expert adapter as a plain LoRA adapter",
    "modules_to_save": "fully trained modules (modules_to_save) are not supported; merge the "
                       "adapter into a new base model, or retrain without modules_to_save",
    "lora_bias": "LoRA bias terms (lora_bias=true) are not supported; retrain with lora_bias=false",
    "trainable_token_indices": "trainable token embeddings are not supported; merge the adapter "
                               "into the base model",
    "layer_replication": "layer_replication changes the base model's layers and is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "use_qalora": "QALoRA adapters are not supported",
}

# init_lora_weights values whose initialisation rewrote the base weights (W - B0 A0, or a
# quantised/residual base): such an adapter is only right on that residual base model. peft's
# save_pretrained(path_initial_model_for_weight_conversion=...) turns it into a plain LoRA adapter
# for the original base (and records init_lora_weights=true).
_RESIDUAL_BASE = {"pissa": "PiSSA", "olora": "OLoRA", "corda": "CorDA", "loftq": "LoftQ", "lora_ga": "LoRA-GA"}

# Variants that are plain LoRA at inference (B @ A x * scaling): their extra tensors only serve
# training, and are skipped. VeLoRA changes the backward pass only (lora_velora_embed is its
# activation-compression state); MonteCLoRA samples A only while training (eval forward is plain).
_TRAINING_ONLY_TENSORS = {"velora_config": (".lora_velora_embed",),
                          "monteclora_config": (".lora_monteclora_sampler.",)}


@dataclass(frozen=True)
class PeftLoraConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: object  # list[str] | str | None
    exclude_modules: object
    rank_pattern: dict
    alpha_pattern: dict
    layers_to_transform: object  # int | list[int] | None
    layers_pattern: object  # str | list[str] | None
    base_model_class: str | None
    training_only: tuple[str, ...] = ()  # tensor-name parts of training-only variant state (skipped)
    # parameters LoRA wraps directly (a mixture-of-experts block's router and stacked experts,
    # lora/experts.py), as PEFT matches them: a full name or its dotted suffix
    target_parameters: tuple[str, ...] = ()

    def targets_parameter(self, key: str) -> bool:
        """peft's target_parameters match for parameter `key` (model.layers.0.mlp.gate.weight)."""
        return any(key == t or key.endswith(f".{t}") for t in self.target_parameters)

    def ignores(self, key: str) -> bool:
        """Whether tensor ``key`` is a training-only tensor of an inference-plain variant."""
        return any(part in key for part in self.training_only)

    @classmethod
    def read(cls, name: str, path: Path) -> "PeftLoraConfig":
        cfg_path = path / "adapter_config.json"
        try:
            raw = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            raise adapter_error(name, path, "adapter_config.json not found; point the adapter at "
                                "a PEFT LoRA directory (saved with save_pretrained)") from None
        except (OSError, ValueError) as e:
            raise adapter_error(name, path, f"cannot read adapter_config.json: {e}") from None
        if not isinstance(raw, dict):
            raise adapter_error(name, path, "adapter_config.json is not a JSON object")
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise adapter_error(name, path, f"adapter_config.json peft_type={peft_type!r}: only "
                                "LoRA adapters (peft_type LORA) are supported")
        for key, fix in _REFUSED.items():
            if raw.get(key):
                raise adapter_error(name, path, f"adapter_config.json {key}={raw[key]!r}: {fix}")
        init = raw.get("init_lora_weights")
        if isinstance(init, str):
            variant = next((v for k, v in _RESIDUAL_BASE.items() if init.lower().startswith(k)), None)
            if variant is not None:
                raise adapter_error(name, path, f"adapter_config.json init_lora_weights={init!r}: a {variant} "
                                    "adapter saved as trained only works on the residual base model its "
                                    "initialisation wrote, not on this one. Convert it to plain LoRA with "
                                    "peft's save_pretrained(..., path_initial_model_for_weight_conversion=...) "
                                    f"or {_MERGE}")
        bias = raw.get("bias", "none")
        if bias not in (None, "none"):
            raise adapter_error(name, path, f"adapter_config.json bias={bias!r}: trained bias "
                                "terms are not supported; retrain with bias='none' or merge the "
                                "adapter into the base model")
        r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise adapter_error(name, path, f"adapter_config.json r={r!r} must be an integer >= 1")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise adapter_error(name, path, f"adapter_config.json lora_alpha={alpha!r} must be a number")
        for key in ("rank_pattern", "alpha_pattern"):
            if not isinstance(raw.get(key) or {}, dict):
                raise adapter_error(name, path, f"adapter_config.json {key} must be an object")
        params = raw.get("target_parameters") or []
        if not isinstance(params, list) or any(not isinstance(p, str) for p in params):
            raise adapter_error(name, path, f"adapter_config.json target_parameters={params!r} "
                                "must be a list of parameter names")
        auto = raw.get("auto_mapping") or {}
        return cls(
            r=r, lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
            target_modules=raw.get("target_modules"), exclude_modules=raw.get("exclude_modules"),
            rank_pattern=dict(raw.get("rank_pattern") or {}),
            alpha_pattern=dict(raw.get("alpha_pattern") or {}),
            layers_to_transform=raw.get("layers_to_transform"),
            layers_pattern=raw.get("layers_pattern"),
            base_model_class=auto.get("base_model_class") if isinstance(auto, dict) else None,
            training_only=tuple(part for key, parts in _TRAINING_ONLY_TENSORS.items() if raw.get(key)
                                for part in parts),
            target_parameters=tuple(params),
        )

    def resolved_targets(self, num_layers: int, modules=PEFT_MODULES):
        """target_modules with "all-linear" expanded the way peft does it (every Linear of the
        decoder layers, `modules`, as full module names; not the output head). None means
        "not recorded": trust the weights."""
        tm = self.target_modules
        if isinstance(tm, str) and tm.lower() == "all-linear":
            return [module_key(i, m) for i in range(num_layers) for m in modules]
        return tm

    def is_target(self, key: str, num_layers: int, modules=PEFT_MODULES) -> bool:
        """peft's check_target_module_exists for one module name."""
        ex = self.exclude_modules
        if ex:
            if isinstance(ex, str):
                if re.fullmatch(ex, key):
                    return False
            elif key in ex or any(key.endswith(f".{e}") for e in ex):
                return False
        tm = self.resolved_targets(num_layers, modules)
        if tm is None:
            return False
        if isinstance(tm, str):
            return re.fullmatch(tm, key) is not None
        if key in tm:
            return True
        if not any(key.endswith(f".{t}") for t in tm):
            return False
        idx = self.layers_to_transform
        if idx is None or (isinstance(idx, list) and not idx):
            return True
        pat = self.layers_pattern
        match = None
        if not pat:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for p in [pat] if isinstance(pat, str) else pat:
                match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
                if match is not None:
                    break
        if match is None:
            return False
        layer = int(match.group("idx"))
        return layer == idx if isinstance(idx, int) else layer in idx

    def _pattern_value(self, patterns: dict, key: str, default):
        # peft's get_pattern_key: the first pattern p (in dict order) with (.*\.)?(p)$ matching.
        for p, v in patterns.items():
            if re.match(rf"(.*\.)?({p})$", key):
                return v
        return default

    def rank_for(self, key: str) -> int:
        return int(self._pattern_value(self.rank_pattern, key, self.r))

    def scaling_for(self, key: str, rank: int) -> float:
        alpha = float(self._pattern_value(self.alpha_pattern, key, self.lora_alpha))
        return alpha / rank ** 0.5 if self.use_rslora else alpha / rank
