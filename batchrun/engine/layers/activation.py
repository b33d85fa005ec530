"""act(gate) * up on the fused gate_up output (SiLU for Llama-style MLPs, GELU-tanh for
Gemma's): one Triton kernel on CUDA, torch on CPU.

A pending LoRA delta of gate_up_proj (LoRADelta) is added to gate and up inside the kernel."""
import torch

from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.reference import ref_act_and_mul
from batchrun.engine.layers.backend import use_triton


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu",
                lora: LoRADelta | None = None) -> torch.Tensor:
    # gate_up: [T, 2*I] -> [T, I]; activation: "silu" or "gelu_tanh" (kernels/act_and_mul.py)
    if use_triton(gate_up):
        from batchrun.kernels.act_and_mul import act_and_mul as triton_act_and_mul
        return triton_act_and_mul(gate_up, activation, lora=lora)
    if lora is not None:
        gate_up = lora.apply_reference(gate_up)
    return ref_act_and_mul(gate_up, activation)
