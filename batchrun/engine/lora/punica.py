"""Punica-style LoRA ops for one fused Linear: y += expand(shrink(x)).

On CUDA the Triton kernels from batchrun.kernels run (a static grid driven by the metadata
buffers, so they can be captured in CUDA graphs). On CPU the engine runs the torch references
instead, by design: they are the same math (fp32 accumulation, one rounding into y) and the
Triton interpreter is far too slow for an engine. Tests force the Triton path on CPU with
BATCHRUN_FORCE_TRITON=1 under TRITON_INTERPRET=1 to check the wrapper against the kernels.
"""
from __future__ import annotations

from torch import Tensor

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.engine.layers.backend import use_triton


def add_lora(x: Tensor, y: Tensor, lora_a: Tensor, lora_b: Tensor, buf: Tensor,
             slice_offsets: tuple[int, ...], meta: LoRAKernelMeta) -> None:
    # x: [T, K]; y: [T, N] updated in place; lora_a: [S, L, R, K]; lora_b: [L, N, R] (scaling
    # folded in); buf: flat fp32 scratch of >= MAX_SPLITS * S * T * R elements, shared by all
    # layers (only the partials of LoRA tokens are written/read); slice_offsets: S + 1 ints into
    # y's columns; meta: prepared for this step's tokens.
    if use_triton(x):
        from batchrun.kernels.lora_expand import lora_expand
        from batchrun.kernels.lora_shrink import lora_shrink, shrink_num_splits
        T, K = x.shape
        S, _, R, _ = lora_a.shape
        # Split-K partials [splits, S, T, R]: a function of static shapes only, so a captured
        # graph replays with the same view of the same memory.
        splits = shrink_num_splits(T, K, S)
        n = splits * S * T * R
        assert buf.dim() == 1 and buf.numel() >= n, f"shrink buffer holds {buf.numel()}, need {n}"
        part = buf[:n].view(splits, S, T, R)
        lora_shrink(x, lora_a, part, meta)
        lora_expand(part, lora_b, y, slice_offsets, meta)
        return
    from batchrun.kernels.reference import ref_lora_expand, ref_lora_shrink
    slots = meta.token_lora_slot[: x.shape[0]]
    # The CPU path needs no scratch buffer: the reference shrink returns its own [S, T, R].
    mid = ref_lora_shrink(x, lora_a, slots)
    y.copy_(ref_lora_expand(y, mid, lora_b, slice_offsets, slots))
