"""Captured CUDA-graph sets for decode: without LoRA ops, and with them per slot bound.

A decode step with no adapter row replays a graph captured from a step with `lora=None`, which
holds exactly the kernels of a LoRA-disabled engine; a step with any adapter row replays a LoRA
graph, captured from a LoRAStep whose tensors are the static buffers each step rewrites. LoRA
graphs come in one set per slot bound k (the LoRA manager's `slot_bounds`: 1 and max_loras): a
step whose rows' slots are all below k replays the set of the smallest such k, whose fused GEMMs
stream only the A rows of slots 0..k-1 (lora/layer.py). All sets share one memory pool,
captured largest size first so smaller graphs reuse its blocks.

A GraphRunner belongs to one ModelRunner (model_runner.py), which creates it, captures it and
replays it; it holds only its graphs and their outputs, and captures through the forward
function it is given.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from batchrun.engine.config import EngineConfig
from batchrun.engine.layers.step import LoRAStep


@dataclass(frozen=True)
class GraphKey:
    padded_batch_size: int
    lora_slots: int  # 0: the no-LoRA set; k > 0: the LoRA set of slot bound k

    @property
    def has_lora(self) -> bool:
        return self.lora_slots > 0


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to max_num_seqs (and max_num_seqs
    itself, so no batch the scheduler can form runs eagerly). Sorted ascending."""
    if sizes is None:
        sizes = [1, 2, 4] + list(range(8, max_num_seqs + 1, 8))
        sizes.append(max_num_seqs)
    sizes = sorted({s for s in sizes if 1 <= s <= max_num_seqs})
    if not sizes:
        raise ValueError(f"no CUDA graph size is within 1..max_num_seqs={max_num_seqs}")
    return sizes


def padded_size_table(sizes: list[int]) -> tuple[int, ...]:
    """table[b] = smallest captured size >= b, for b in 0..max(sizes)."""
    table, j = [], 0
    for b in range(max(sizes) + 1):
        while sizes[j] < b:
            j += 1
        table.append(sizes[j])
    return tuple(table)


def dispatch(batch_size: int, lora_slots: int, table: tuple[int, ...]) -> GraphKey | None:
    """Graph to replay for a decode step of slot bound `lora_slots` (0: no adapter row); None =
    run eagerly (larger than any captured size)."""
    if batch_size < 1:
        raise ValueError(f"decode batch size must be >= 1, got {batch_size}")
    if lora_slots < 0:
        raise ValueError(f"lora_slots must be >= 0, got {lora_slots}")
    if batch_size >= len(table):
        return None
    return GraphKey(table[batch_size], lora_slots)


class GraphRunner:
    def __init__(self, config: EngineConfig, with_lora: bool):
        self.with_lora = with_lora  # LoRA sets are captured too
        self.sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
        self.table = padded_size_table(self.sizes)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.pool = None
        self.stats: dict = {}

    def dispatch(self, batch_size: int, lora_slots: int) -> GraphKey | None:
        if lora_slots and not self.with_lora:
            raise AssertionError("a LoRA row reached an engine without LoRA")
        return dispatch(batch_size, lora_slots, self.table)

    def replay(self, key: GraphKey) -> torch.Tensor:
        self.graphs[key].replay()
        return self.outputs[key]

    @torch.inference_mode()
    def capture(self, forward: Callable[[int, LoRAStep | None], torch.Tensor],
                lora: dict[int, LoRAStep] | None) -> None:
        """Capture `forward(size, lora_step)` for every size, once with lora_step=None and, when
        with_lora, once per LoRAStep of `lora` (slot bound -> its step, whose num_slots it is;
        their tensors must stay allocated: the graphs read them). The caller has set its static
        inputs to a step of padding rows."""
        if self.with_lora != bool(lora):
            raise ValueError(f"GraphRunner(with_lora={self.with_lora}) needs "
                             f"{'LoRA steps' if self.with_lora else 'no LoRA step'} to capture")
        if lora and any(k != step.num_slots or k < 1 for k, step in lora.items()):
            raise ValueError(f"LoRA steps must be keyed by their slot bound, got "
                             f"{ {k: s.num_slots for k, s in lora.items()} }")
        t0 = time.perf_counter()
        # the largest slot bound first (its GEMM outputs are the widest): later sets reuse it
        sets = [None] + [lora[k] for k in sorted(lora or {}, reverse=True)]
        self.pool = torch.cuda.graph_pool_handle()
        pool_bytes = {}
        for step_lora in sets:
            slots = 0 if step_lora is None else step_lora.num_slots
            # warm-up: every size once eagerly, so Triton compiles all specialisations and
            # cuBLAS picks its kernels before capture, not during
            for size in reversed(self.sizes):
                forward(size, step_lora)
            # torch.cuda.graph() empties the allocator cache on entry; do it first so the
            # difference below is only what this set's captures add to the shared pool
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved()
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                key = GraphKey(size, slots)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[key] = forward(size, step_lora)
                self.graphs[key] = graph
            torch.cuda.synchronize()
            pool_bytes[f"lora_{slots}" if slots else "no_lora"] = torch.cuda.memory_reserved() - before
        self.stats = {"capture_s": time.perf_counter() - t0, "sizes": list(self.sizes),
                      "num_graphs": len(self.graphs), "pool_bytes": pool_bytes}
