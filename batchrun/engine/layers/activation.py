"""SiLU(gate) * up on the fused gate_up output: one Triton kernel on CUDA, torch on CPU.

A pending LoRA delta of gate_up_proj (LoRADelta) is added to gate and up inside the kernel."""
import torch

from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.reference import ref_silu_and_mul
from batchrun.engine.layers.backend import use_triton


def silu_and_mul(gate_up: torch.Tensor, lora: LoRADelta | None = None) -> torch.Tensor:
    # gate_up: [T, 2*I] -> [T, I]
    if use_triton(gate_up):
        from batchrun.kernels.silu_and_mul import silu_and_mul as triton_silu_and_mul
        return triton_silu_and_mul(gate_up, lora=lora)
    if lora is not None:
        gate_up = lora.apply_reference(gate_up)
    return ref_silu_and_mul(gate_up)
