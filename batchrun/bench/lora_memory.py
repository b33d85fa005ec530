"""Where a LoRA engine's memory goes: the LoRA manager's device buffers, summed by tensor size.

Categories (bytes):
    slots_a        A of every slot: the rows under each base weight in the stacked [W; A]
                   tensor (layer.py), S slices x max_loras x R x in
    slots_b        B of every slot: max_loras x out x R per hooked Linear
    stacked_base   the base weight rows of the stacked tensors: the model's weights, moved
                   there (no extra cost once the original copy is freed; listed, not added)
    bias_extra     bias rows beside A (biased Linears only)
    fused_buffers  fused-step metadata: the kernel metadata buffer and the RMSNorm scratch
    workspace      the shared split-K shrink buffer (fp32)
    total_extra    everything but stacked_base

`measured` (CUDA only, from build_engine): torch.cuda.memory_allocated after minus before
building the engine, less its weights and KV cache; the LoRA engine's figure minus the
LoRA-disabled engine's is what enabling LoRA cost beyond the KV cache, measured.
"""
from __future__ import annotations

MIB = 1 << 20


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def lora_memory(engine) -> dict | None:
    """Bytes per category of engine.lora's device buffers; None without LoRA."""
    m = engine.lora
    if m is None:
        return None
    out = {"slots_a": 0, "slots_b": 0, "stacked_base": 0, "bias_extra": 0}
    for hook in m.hooks.values():
        a = _nbytes(hook.lora_a)
        out["slots_a"] += a
        out["slots_b"] += _nbytes(hook.lora_b)
        if hasattr(hook, "weight_full"):  # a Linear's A rows live under its weight (an MoE
            out["stacked_base"] += _nbytes(hook.weight_full) - a  # block's hooks: A alone)
        if hook.bias_full is not None:
            n = hook.slice_offsets[-1]
            out["bias_extra"] += (hook.bias_full.numel() - n) * hook.bias_full.element_size()
    out["fused_buffers"] = _nbytes(getattr(m.meta, "flat", None))
    out["workspace"] = _nbytes(m.shrink_buffer)
    out["total_extra"] = sum(v for k, v in out.items() if k != "stacked_base")
    out.update(hooked_linears=len(m.hooks), max_loras=m.max_loras, rank=m.rank)
    return out


def format_lora_memory(mem: dict | None, measured_extra: float | None = None) -> str:
    """One line: 'LoRA memory: slots A .. + B .. MiB, fused buffers .., workspace .. = ..'."""
    if mem is None:
        return "LoRA memory: LoRA disabled"
    mib = {k: mem[k] / MIB for k in ("slots_a", "slots_b", "bias_extra", "fused_buffers",
                                     "workspace", "total_extra", "stacked_base")}
    line = (f"LoRA memory ({mem['hooked_linears']} hooked Linears, {mem['max_loras']} slots, "
            f"rank {mem['rank']}): slots A {mib['slots_a']:.1f} MiB (inside the stacked [W; A] "
            f"weights, whose W rows, {mib['stacked_base']:.1f} MiB, are the base weights) + "
            f"B {mib['slots_b']:.1f} MiB, fused-step buffers {mib['fused_buffers']:.2f} MiB, "
            f"workspace {mib['workspace']:.1f} MiB")
    if mem["bias_extra"]:
        line += f", bias rows {mib['bias_extra']:.2f} MiB"
    line += f" = {mib['total_extra']:.1f} MiB"
    if measured_extra is not None:
        line += (f"; measured (allocated beyond weights and KV, vs the LoRA-disabled engine): "
                 f"{measured_extra / MIB:+.1f} MiB")
    return line
