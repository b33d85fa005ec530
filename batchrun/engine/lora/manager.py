"""LoRA slot manager: GPU slots of stacked adapter weights, an LRU CPU cache behind them.

Every adapter is validated at construction (shapes from the safetensors header only), so a bad
adapter fails before any GPU work. Each fused Linear that some adapter targets gets a
`LoRALinear` hook holding [S, max_loras, R, in] (stacked under the base weight, see layer.py) /
[max_loras, out, R] weights, where R is the
largest rank among the adapters (<= max_lora_rank): the adapter set is fixed for the engine's
life, and a smaller R means smaller buffers and cheaper kernels. For the same reason max_loras
is a cap: an engine with fewer adapters gets one slot per adapter (`self.max_loras`), since a
slot beyond the adapter count could never be used while a LoRA step's fused GEMM would stream
its A rows every step. Linears no adapter targets get no hook and launch nothing. A
mixture-of-experts block's router and stacked experts that an adapter targets (peft's
target_parameters) get `ExpertLoRA` slot buffers instead (lora/experts.py): the router's when
targeted, the experts' gate_up and down together when either is (the fused MoE kernel applies
both; an untargeted one stays zero). Loading an
adapter into a slot copies into those buffers in place; they are never reallocated, because
captured CUDA graphs hold their addresses.

Scheduler contract: acquire(name) pins an adapter in a slot (refcounted) for as long as a
sequence using it is running; release(name) unpins. Unpinned residents stay loaded and are
evicted least-recently-acquired first when a new adapter needs a slot.

Active adapters are kept in the lowest slots: a fused LoRA step streams the A rows of slots
0..k-1 only, k = the step's slot bound (`slot_bound`: the smallest of `slot_bounds` above every
token's slot), so one active adapter in slot 0 costs one slot's A rows, not max_loras'. An
adapter that becomes active (acquired with no pin) while a lower slot is free or holds an
unpinned adapter swaps slots with it (a copy on the device; neither is in use by a running
sequence), and a newly loaded adapter takes the lowest slot held by an unpinned adapter, which
moves into the freed or evicted slot instead.

Model runner contract: lora_step(slots) writes the step's kernel metadata into the static
buffers and returns the frozen LoRAStep the model runner puts into its Step (None: no adapter
token, nothing written). The manager keeps adapters, slots and the CPU cache; no per-step state.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch
from torch import Tensor

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.engine.layers.linear import Linear
from batchrun.engine.layers.step import LoRAStep
from batchrun.engine.lora.adapters import AdapterInfo, LoRAWeights, inspect_adapter, load_adapter
from batchrun.engine.lora.experts import DOWN, GATE_UP
from batchrun.engine.lora.expert_layer import ExpertLoRA
from batchrun.engine.lora.layer import LoRALinear
from batchrun.engine.models.decoder import SparseMoE

MAX_SHRINK_SPLITS = 32  # kernels.lora_shrink.MAX_SPLITS (a test checks they agree)
_MOE = re.compile(r"(?:^|.*\.)layers\.(\d+)\.mlp$")
_LINEAR = re.compile(r"(?:^|.*\.)layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")


class LoRAManager:
    def __init__(self, model, adapter_paths: dict[str, str | Path], *, max_loras: int,
                 max_lora_rank: int, max_num_tokens: int, max_cpu_loras: int | None = None,
                 device, dtype: torch.dtype):
        if max_loras < 1 or max_lora_rank < 1 or max_num_tokens < 1:
            raise ValueError(f"max_loras, max_lora_rank and max_num_tokens must be >= 1, got "
                             f"{max_loras}, {max_lora_rank}, {max_num_tokens}")
        if max_cpu_loras is not None and max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be >= 1 or None, got {max_cpu_loras}")
        self.model_config = model.config
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras, self.dtype = max_cpu_loras, dtype
        # Validate all adapters first: nothing is allocated if one of them is bad.
        self.infos: dict[str, AdapterInfo] = {
            name: inspect_adapter(name, path, self.model_config, max_lora_rank)
            for name, path in adapter_paths.items()}
        self.rank = max((i.max_rank for i in self.infos.values()), default=1)
        self.max_loras = max_loras = max(1, min(max_loras, len(self.infos)))  # GPU slots
        # the slot bounds a step can have, one decode graph set each: 1 (the common case with
        # active adapters kept low: one adapter at a time, as a job's shards run) and max_loras.
        # Every set more costs capture time and graph memory for little (decision log:
        # docs/benchmarks.md); 1 and 8: three sets with the no-LoRA one
        self.slot_bounds = tuple(sorted({1, max_loras}))
        targeted = {m for info in self.infos.values() for m in info.modules}

        # Static buffers, allocated once (captured graphs hold their addresses). What a step
        # runs is not kept here: lora_step() returns it as a frozen LoRAStep (layers/step.py).
        self.meta = LoRAKernelMeta.allocate(max_num_tokens, max_loras, device)
        self.hooks: dict[tuple[int, str], LoRALinear] = {}
        for mod_name, mod in model.named_modules():
            moe = _MOE.match(mod_name)
            if moe is not None and isinstance(mod, SparseMoE):
                self._hook_experts(int(moe.group(1)), mod, targeted, device)
                continue
            m = _LINEAR.match(mod_name)
            if m is None or not isinstance(mod, Linear):
                continue
            key = (int(m.group(1)), m.group(2))
            if key in targeted:
                hook = LoRALinear(self, mod, max_loras, self.rank)
                mod.lora = hook
                self.hooks[key] = hook
        if torch.device(device).type == "cuda":
            # the hooks re-allocated the targeted weights: hand the old copies back before the
            # engine sizes the KV cache from free memory
            torch.cuda.empty_cache()
        missing = targeted - self.hooks.keys()
        assert not missing, f"model has no Linear for LoRA targets {sorted(missing)[:4]}"
        max_slices = max((h.num_slices for h in self.hooks.values()), default=1)
        # Shared by all hooks (layers run one after another), allocated once (captured graphs
        # hold its address): flat fp32 room for the shrink's split-K partials [splits, S, T, R]
        # at their largest, splits <= MAX_SHRINK_SPLITS (= kernels.lora_shrink.MAX_SPLITS, not
        # imported here: that would import triton on the CPU path).
        self.shrink_buffer = torch.zeros(MAX_SHRINK_SPLITS * max_slices * max_num_tokens * self.rank,
                                         device=device, dtype=torch.float32)

        self._slot_owner: list[str | None] = [None] * max_loras
        self._resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, LRU first
        self._pins: dict[str, int] = {}
        self._cpu: OrderedDict[str, LoRAWeights] = OrderedDict()  # LRU CPU cache
        self.num_loads = 0  # adapters read from disk (tests, metrics)
        self.num_moves = 0  # slot swaps that kept active adapters low (tests, metrics)

    # ---- scheduler API ------------------------------------------------------------------
    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.infos)

    def can_acquire(self, name: str) -> bool:
        self._check_name(name)
        if name in self._resident or None in self._slot_owner:
            return True
        return any(self._pins.get(n, 0) == 0 for n in self._resident)

    def acquire(self, name: str) -> int:
        self._check_name(name)
        if name not in self._resident:
            slot = self._free_slot()
            weights = self._cpu_get(name)  # may read the disk; slot state untouched until done
            low = self._lowest_inactive(below=slot)
            if low is not None:  # an unpinned adapter sits lower: it moves up instead
                self._swap(low, slot)
                slot = low
            self._write_slot(slot, weights)
            self._resident[name] = slot
            self._slot_owner[slot] = name
        elif self._pins.get(name, 0) == 0:  # becomes active: into the lowest slot not in use
            low = self._lowest_inactive(below=self._resident[name])
            if low is not None:
                self._swap(low, self._resident[name])
        self._resident.move_to_end(name)
        self._pins[name] = self._pins.get(name, 0) + 1
        return self._resident[name]

    def release(self, name: str) -> None:
        if self._pins.get(name, 0) <= 0:
            raise RuntimeError(f"release({name!r}) without a matching acquire")
        self._pins[name] -= 1

    def slot_of(self, name: str) -> int:
        if name not in self._resident:
            raise KeyError(f"LoRA adapter {name!r} is not loaded in a GPU slot (acquire it first)")
        return self._resident[name]

    def pinned(self, name: str) -> int:
        return self._pins.get(name, 0)

    # ---- per-step value ----------------------------------------------------------------
    def slot_bound(self, max_slot: int) -> int:
        """The step's slot bound k for tokens whose highest slot is max_slot: the smallest of
        `slot_bounds` above it (a fused GEMM then computes the shrink of slots 0..k-1)."""
        if not 0 <= max_slot < self.max_loras:
            raise ValueError(f"slot {max_slot} is outside 0..{self.max_loras - 1}")
        return next(k for k in self.slot_bounds if k > max_slot)

    def lora_step(self, token_slots: Tensor | list[int], has_lora: bool | None = None,
                  fuse: bool = False, bound_slots: Tensor | None = None,
                  num_slots: int | None = None) -> LoRAStep | None:
        """This step's LoRA part for tokens with slots `token_slots` (-1 = no LoRA), or None
        when no token has an adapter (then nothing is written and no LoRA op runs).

        Writes the kernels' metadata (the static `meta` buffers) unless `bound_slots` is given.
        fuse=True (steps on the Triton path) lets hooks hand their delta to the next kernel
        (see layer.py) instead of running shrink + expand. bound_slots (fused decode steps):
        an int32 [>= T] buffer the caller already wrote the slots into, read by the fused
        kernels as is, so nothing is written here (token_slots is not read; has_lora must be
        given: the caller knows it from the host-side slots).

        has_lora=None computes it from a list or a CPU tensor. For a CUDA tensor it would need a
        host sync, so it is assumed True instead (correct either way: slot -1 rows are left
        alone by the kernels); callers that know better pass has_lora explicitly.

        num_slots: the step's slot bound (one of `slot_bounds`, above every token's slot). None:
        slot_bound() of the highest slot of a list or CPU tensor, all slots otherwise (a CUDA
        tensor, bound_slots)."""
        if num_slots is not None and num_slots not in self.slot_bounds:
            raise ValueError(f"num_slots must be one of {self.slot_bounds}, got {num_slots}")
        if bound_slots is not None:
            if bound_slots.dtype != torch.int32 or bound_slots.dim() != 1:
                raise ValueError(f"bound_slots must be a 1-D int32 tensor, got "
                                 f"{bound_slots.dtype} {tuple(bound_slots.shape)}")
            if not fuse or has_lora is None:
                raise ValueError("bound_slots needs fuse=True and an explicit has_lora")
            k = self.max_loras if num_slots is None else num_slots
            return LoRAStep(self.meta, bound_slots, fuse=True, num_slots=k) if has_lora else None
        k = num_slots
        if isinstance(token_slots, Tensor):
            if has_lora is None:
                has_lora = bool((token_slots >= 0).any()) if not token_slots.is_cuda else True
            if has_lora:  # a no-LoRA step launches no LoRA kernels, so its meta is never read
                slots = token_slots if token_slots.dtype == torch.int32 else token_slots.to(torch.int32)
                self.meta.prepare(slots)
                if k is None:
                    k = (self.max_loras if token_slots.is_cuda
                         else self.slot_bound(max(0, int(token_slots.max()))))
        else:
            if has_lora is None:
                has_lora = any(s >= 0 for s in token_slots)
            if has_lora:  # computed on the host, one copy to the device
                assert max(token_slots) < self.max_loras and min(token_slots) >= -1, "bad slot id"
                self.meta.prepare_host(token_slots)
                if k is None:
                    k = self.slot_bound(max(0, max(token_slots)))
        if not has_lora:
            return None
        return LoRAStep(self.meta, self.meta.token_lora_slot, fuse, num_slots=k)

    # ---- internals ----------------------------------------------------------------------
    def _hook_experts(self, layer: int, block: SparseMoE, targeted, device) -> None:
        """ExpertLoRA hooks for the router and expert tensors of `block` some adapter targets."""
        shapes = block.lora_shapes()  # module -> (experts, in, out)
        experts_targeted = any((layer, m) in targeted for m in (GATE_UP, DOWN))
        for module, (experts, fan_in, fan_out) in shapes.items():
            if (layer, module) not in targeted and not (module in (GATE_UP, DOWN) and experts_targeted):
                continue
            hook = ExpertLoRA(experts, fan_in, fan_out, self.max_loras, self.rank, device,
                              block.gate.weight.dtype)
            block.lora[module] = hook
            self.hooks[(layer, module)] = hook

    def _check_name(self, name: str) -> None:
        if name not in self.infos:
            raise KeyError(f"unknown LoRA adapter {name!r}; known: {sorted(self.infos)}")

    def _free_slot(self) -> int:
        if None in self._slot_owner:
            return self._slot_owner.index(None)
        for victim, slot in self._resident.items():  # least recently acquired first
            if self._pins.get(victim, 0) == 0:
                del self._resident[victim]
                self._slot_owner[slot] = None
                return slot
        raise RuntimeError(f"all {self.max_loras} LoRA slots are pinned by running sequences "
                           f"({sorted(self._resident)}); check can_acquire() before acquire()")

    def _lowest_inactive(self, below: int) -> int | None:
        """Lowest slot under `below` that is free or holds an unpinned adapter, or None."""
        for slot in range(below):
            owner = self._slot_owner[slot]
            if owner is None or self._pins.get(owner, 0) == 0:
                return slot
        return None

    def _swap(self, i: int, j: int) -> None:
        """Swap the contents and owners of slots i and j (neither pinned: no running sequence
        reads them)."""
        for hook in self.hooks.values():
            hook.swap_slots(i, j)
        a, b = self._slot_owner[i], self._slot_owner[j]
        self._slot_owner[i], self._slot_owner[j] = b, a
        for name, slot in ((b, i), (a, j)):
            if name is not None:
                self._resident[name] = slot
        self.num_moves += 1

    def _cpu_get(self, name: str) -> LoRAWeights:
        if name in self._cpu:
            self._cpu.move_to_end(name)
            return self._cpu[name]
        info = self.infos[name]
        weights = load_adapter(name, info.path, self.model_config, self.max_lora_rank, self.dtype)
        self.num_loads += 1
        self._cpu[name] = weights
        if self.max_cpu_loras is not None:
            while len(self._cpu) > self.max_cpu_loras:
                self._cpu.popitem(last=False)
        return weights

    def _write_slot(self, slot: int, weights: LoRAWeights) -> None:
        per_linear: dict[tuple[int, str], dict[int, tuple[Tensor, Tensor]]] = {}
        for (layer, module, sl), ab in weights.weights.items():
            per_linear.setdefault((layer, module), {})[sl] = ab
        for key, hook in self.hooks.items():
            if key in per_linear:
                hook.set_slot(slot, per_linear[key])
            else:
                hook.clear_slot(slot)

