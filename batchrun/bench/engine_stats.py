"""What a built engine holds: CUDA-graph capture stats and memory (weights, KV cache, LoRA)."""
from __future__ import annotations

import torch

from batchrun.bench.lora_memory import lora_memory
from batchrun.engine.engine import weight_bytes  # noqa: F401  (re-exported: roofline, tests)

MIB = 1 << 20
GIB = 1 << 30


def graph_stats(engine) -> dict:
    """Decode graphs' capture time, sizes and pool memory per graph set, and under "prefill"
    the piecewise prefill graphs' capture time, token sizes and sets (None when the engine
    has none); {"enabled": False} when eager."""
    g = engine.runner.graphs
    if g is None:
        return {"enabled": False}
    st = dict(g.stats)
    pools = st.get("pool_bytes", {})
    pg = engine.runner.prefill_graphs
    return {"enabled": True, "capture_s": st.get("capture_s"), "sizes": st.get("sizes"),
            "num_graphs": st.get("num_graphs"), "pool_bytes": dict(pools),
            "pool_mib": {k: v / MIB for k, v in pools.items()},
            "prefill": dict(pg.stats) if pg is not None else None}


def memory_stats(engine, built=None) -> dict:
    """Weights, KV cache, LoRA buffers (lora_memory.py, by category) and, on CUDA, what building
    the engine allocated beyond its weights and KV cache (`other_allocated_bytes`)."""
    weights = weight_bytes(engine.model)
    kv = engine.runner.kv_cache
    lora = 0
    if engine.lora is not None:
        lora = sum(h.lora_a.numel() * h.lora_a.element_size() +
                   h.lora_b.numel() * h.lora_b.element_size() for h in engine.lora.hooks.values())
    kv_bytes = kv.numel() * kv.element_size()
    out = {"weights_gib": weights / GIB, "kv_cache_gib": kv_bytes / GIB,
           "kv_blocks": engine.blocks.num_blocks, "lora_slots_gib": lora / GIB,
           "lora_breakdown_bytes": lora_memory(engine)}
    if built is not None and built.allocated_bytes is not None:
        out["other_allocated_bytes"] = built.allocated_bytes - weights - kv_bytes
    if engine.device.type == "cuda":
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated(engine.device) / GIB
        out["reserved_gib"] = torch.cuda.memory_reserved(engine.device) / GIB
    return out
