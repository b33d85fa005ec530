"""Which GEMM a projection runs: cuBLAS (F.linear), or, on steps of a few rows, batchrun's Triton
GEMM that only streams the weight (kernels/skinny_gemm.py; for gate_up with SiLU-and-mul in its
epilogue, kernels/skinny_gate_up_silu.py).

`EngineConfig.triton_decode_gemm` (on by default) turns it on for a model's Linears
(`set_decode_gemm`). A Linear then takes the Triton GEMM when all of these hold:

- the step has at most 16 rows (decode at latency batch sizes: what a captured graph of batch
  <= 16 replays);
- Triton runs (CUDA, or BATCHRUN_FORCE_TRITON on CPU for tests) and the dtype is fp16 / bf16;
- the weight has at least MIN_WEIGHT_ELEMENTS (48M) elements. Narrower weights give too few
  programs (N / 32) too little of W each, and cuBLAS (with split-K) kept up or won: at M = 8
  Llama-2-7b's o_proj ([4096, 4096]) took 9.7 us in Triton against 9.5 in cuBLAS on the H100
  (10.2 vs 9.1 on the H200), its down_proj ([4096, 11008], 45M) 37.6 against 36.1 on the H100
  (26.1 vs 28.6 on the H200); while qkv ([12288, 4096]) was 8 % faster, gate_up with its SiLU
  ([22016, 4096]) 9 % and lm_head ([32000, 4096]) 7 % (docs/benchmarks.md, sessions 8 and 11).

Narrow weights (o_proj, down_proj) stay on cuBLAS. The skinny-vs-cuBLAS figures above timed
one weight over and over, so o's 33.5 MB sat in L2.

Steps of more rows (a throughput batch's decode, prefill) stay on cuBLAS: a Triton GEMM with
every row of a 192-256-row step in one M tile (each weight tile read once) lost to it on every
7b shape, 1.31 x a step's GEMMs and the offline job 5.1 % slower (H100, docs/benchmarks.md,
session 17), and was removed.

The result differs from cuBLAS's by at most rounding (an ulp where cuBLAS splits K), as any two
GEMMs do; a given step shape always takes the same kernel, so graph replay equals eager, and the
no-LoRA graph of a LoRA engine launches exactly the LoRA-disabled engine's kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from batchrun.engine.layers.backend import use_triton
from batchrun.kernels.lora_meta import LoRADelta

MAX_ROWS = 16  # kernels/skinny_gemm.py's MAX_ROWS
MIN_WEIGHT_ELEMENTS = 12288 * 4096  # 48M: Llama-2-7b's qkv_proj takes it, down_proj (45M) not
_HALF = (torch.float16, torch.bfloat16)


def takes_skinny(enabled: bool, x: Tensor, weight: Tensor) -> bool:
    """Whether x @ weight.T runs in the Triton skinny GEMM (see the module docstring)."""
    return (enabled and x.shape[0] <= MAX_ROWS and x.dtype in _HALF and use_triton(x)
            and weight.numel() >= MIN_WEIGHT_ELEMENTS)


def gemm_kernel(decode_gemm: bool, x: Tensor, weight: Tensor) -> str | None:
    """The GEMM x @ weight.T runs in: "skinny" or None (cuBLAS)."""
    return "skinny" if takes_skinny(decode_gemm, x, weight) else None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, kernel: str | None) -> Tensor:
    # x [T, K] @ weight [N, K].T (+ bias) -> [T, N]; kernel: gemm_kernel's answer
    if kernel == "skinny":
        from batchrun.kernels.skinny_gemm import skinny_gemm
        return skinny_gemm(x, weight, bias)
    if kernel is not None:
        raise ValueError(f"unknown GEMM kernel {kernel!r}: skinny or None")
    return F.linear(x, weight, bias)


def gate_up_silu(x: Tensor, weight: Tensor, lora: LoRADelta | None = None) -> Tensor:
    # x [T <= 16, K], the gate_up weight [2I, K] -> silu(gate) * up [T, I], one launch;
    # lora: gate_up's delta (its shrink computed by the norm before), added before the SiLU
    from batchrun.kernels.skinny_gate_up_silu import skinny_gate_up_silu
    return skinny_gate_up_silu(x, weight, lora=lora)


def set_decode_gemm(model: torch.nn.Module, enabled: bool) -> None:
    """Turn the Triton decode GEMM on or off for every projection of `model` and lm_head."""
    for m in model.modules():  # each Linear, and the model itself for lm_head
        if hasattr(m, "decode_gemm"):
            m.decode_gemm = enabled

