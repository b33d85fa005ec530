"""Two captured CUDA-graph sets for decode: with LoRA ops and without.

A decode step with no adapter row replays a graph captured with LoRA off, which holds exactly
the kernels of a LoRA-disabled engine; a step with any adapter row replays the LoRA set. Both
sets share one memory pool, captured largest size first so smaller graphs reuse its blocks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from batchrun.config import EngineConfig


@dataclass(frozen=True)
class GraphKey:
    padded_batch_size: int
    has_lora: bool


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


def dispatch(batch_size: int, has_lora: bool, table: tuple[int, ...]) -> GraphKey | None:
    """Graph to replay for a decode step; None = run eagerly (larger than any captured size)."""
    if batch_size < 1:
        raise ValueError(f"decode batch size must be >= 1, got {batch_size}")
    if batch_size >= len(table):
        return None
    return GraphKey(table[batch_size], has_lora)


class GraphRunner:
    def __init__(self, runner, config: EngineConfig, lora=None):
        self.runner, self.lora = runner, lora
        self.sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
        self.table = padded_size_table(self.sizes)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.pool = None
        self.stats: dict = {}

    def dispatch(self, batch_size: int, has_lora: bool) -> GraphKey | None:
        if has_lora and self.lora is None:
            raise AssertionError("a LoRA row reached an engine without LoRA")
        return dispatch(batch_size, has_lora, self.table)

    def replay(self, key: GraphKey) -> torch.Tensor:
        self.graphs[key].replay()
        return self.outputs[key]

    @torch.inference_mode()
    def capture(self) -> None:
        r = self.runner
        t0 = time.perf_counter()
        sets = [False] + ([True] if self.lora is not None else [])
        largest = self.sizes[-1]
        # inputs of a step made only of padding rows: scratch block, no context, no LoRA
        r.input_ids.zero_(); r.positions.zero_(); r.slot_mapping.zero_()
        r.context_lens.zero_(); r.block_tables.zero_(); r.token_slots.fill_(-1)
        self.pool = torch.cuda.graph_pool_handle()
        pool_bytes = {}
        for has_lora in sets:
            self._set_lora(has_lora, largest)
            # warm-up: every size once eagerly, so Triton compiles all specialisations and
            # cuBLAS picks its kernels before capture, not during
            for size in reversed(self.sizes):
                self._set_lora(has_lora, size)
                r.decode_forward(size)
            # torch.cuda.graph() empties the allocator cache on entry; do it first so the
            # difference below is only what this set's captures add to the shared pool
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved()
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
                key = GraphKey(size, has_lora)
                self._set_lora(has_lora, size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[key] = r.decode_forward(size)
                self.graphs[key] = graph
            torch.cuda.synchronize()
            pool_bytes["lora" if has_lora else "no_lora"] = torch.cuda.memory_reserved() - before
        if self.lora is not None:
            self.lora.has_lora = False
        self.stats = {"capture_s": time.perf_counter() - t0, "sizes": list(self.sizes),
                      "num_graphs": len(self.graphs), "pool_bytes": pool_bytes}

    def _set_lora(self, has_lora: bool, size: int) -> None:
        if self.lora is None:
            return
        if has_lora:  # meta describing `size` padding tokens (slot -1): kernels launch, skip work
            self.lora.prepare_step(self.runner.token_slots[:size], has_lora=True, fuse=True,
                                   slots_bound=True)
        self.lora.has_lora = has_lora
