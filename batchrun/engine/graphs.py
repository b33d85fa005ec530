"""Full CUDA graphs of decode steps, one per (batch size, LoRA set) (cudagraph_dispatcher.py
keys, dispatches and captures them).

A decode step with no adapter row replays a graph captured from a step with `lora=None`, which
holds exactly the kernels of a LoRA-disabled engine; a step with any adapter row replays a LoRA
graph, captured from a LoRAStep whose tensors are the static buffers each step rewrites. LoRA
graphs come in one set per slot bound k (the LoRA manager's `slot_bounds`: 1 and max_loras): a
step whose rows' slots are all below k replays the set of the smallest such k, whose fused GEMMs
stream only the A rows of slots 0..k-1 (lora/layer.py).

The graphs read the model runner's static decode inputs (model_runner.py) and write the shared
logits buffer; this holds only the graphs and their outputs.
"""
from __future__ import annotations

import torch

from batchrun.engine.cudagraph_dispatcher import Forward, GraphKey
from batchrun.engine.layers.step import LoRAStep


class DecodeGraphs:
    decode_only = True
    failure_hint = None  # a failed decode capture is reported as it is

    def __init__(self, sizes: list[int]):
        self.sizes = list(sizes)  # batch sizes, ascending (cudagraph_dispatcher.capture_sizes)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.pool = None  # set by CudaGraphs.capture: one pool for every set
        self.stats: dict = {}

    def replay(self, key: GraphKey) -> torch.Tensor:
        self.graphs[key].replay()
        return self.outputs[key]

    def warm_up(self, forward: Forward, size: int, lora: LoRAStep | None) -> None:
        forward(size, lora)

    def capture_one(self, forward: Forward, key: GraphKey, lora: LoRAStep | None) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = forward(key.tokens, lora)
        self.graphs[key] = graph

    def record_stats(self, capture_s: float, slot_bounds: list[int], pool_bytes: dict) -> None:
        self.stats = {"capture_s": capture_s, "sizes": list(self.sizes),
                      "num_graphs": len(self.graphs), "pool_bytes": pool_bytes}
