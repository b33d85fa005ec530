"""SiLU(gate) * up on the fused gate_up output: one Triton kernel on CUDA, torch on CPU."""
import torch

from batchrun.kernels.reference import ref_silu_and_mul


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2*I] -> [T, I]
    if gate_up.is_cuda:
        from batchrun.kernels.silu_and_mul import silu_and_mul as triton_silu_and_mul
        return triton_silu_and_mul(gate_up)
    return ref_silu_and_mul(gate_up)
