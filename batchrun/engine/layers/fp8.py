"""FP8 Linear layers: turning a Linear into an FP8 one, quantizing a weight, and running its GEMM.

An FP8 Linear (models/quant.py's schemes) holds `weight` as e4m3 [N, K], `weight_scale` fp32
([N] per row, or [ceil(N/bn), ceil(K/bk)] per block) and, for static activations,
`input_scale` fp32 [1]; `linear.quant` is its QuantScheme. Its GEMM quantizes the input as the
scheme says and multiplies the two scaled operands with fp32 sums:

- CPU: the declared math in fp32 (kernels/reference.py ref_fp8_linear), so CI checks loading,
  scale layouts and the quantization itself;
- CUDA: the input quantized in one launch (kernels/fp8_quant.py), then the GEMM the step plan
  names: None = torch._scaled_mm with row-wise scales (cuBLASLt / CUTLASS FP8 tensor cores);
  "fp8" = batchrun's Triton scaled GEMM (kernels/fp8_gemm.py), for block scales, for shapes
  _scaled_mm does not take, and at decode's few rows, where it streams the FP8 weight once.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from batchrun.kernels.reference import FP8_MAX, FP8_MIN_SCALE, ref_fp8_linear
from batchrun.engine.layers.backend import use_triton

FP8 = torch.float8_e4m3fn


def make_fp8(linear, scheme, scale_shape: tuple[int, ...]) -> None:
    """Give `linear` (on the meta device, before storage is allocated) FP8 parameters."""
    n, k = linear.out_features, linear.in_features
    linear.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device="meta"), requires_grad=False)
    linear.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32, device="meta"),
                                       requires_grad=False)
    if scheme.activations == "static":
        linear.input_scale = nn.Parameter(torch.empty(1, dtype=torch.float32, device="meta"),
                                          requires_grad=False)
    linear.quant = scheme


def weight_scale_shape(scheme, n: int, k: int) -> tuple[int, ...]:
    if scheme.weights == "block":
        bn, bk = scheme.block
        return (-(-n // bn), -(-k // bk))
    return (n,)


@torch.no_grad()
def quantize_rows(w: Tensor, q_out: Tensor, scale_out: Tensor) -> None:
    """Per-channel FP8 of a weight (rows of [n, K]) into q_out (e4m3 [n, K]) and scale_out
    (fp32 [n]): each row's amax maps to 448 (engine.quantization: fp8)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    scale_out.copy_(scale)
    q_out.copy_((wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8))


def fp8_linear(x: Tensor, linear, kernel: str | None) -> Tensor:
    # x [T, K] -> [T, N] in x's dtype; kernel: the step plan's entry for this projection
    s = linear.quant
    if not use_triton(x):
        return ref_fp8_linear(x, linear.weight, linear.weight_scale, s.activations, s.block,
                              linear.input_scale, linear.bias)
    from batchrun.kernels.fp8_quant import quant_fp8
    group = s.block[1] if s.activations == "group" else None
    xq, xs = quant_fp8(x, group=group, scale=linear.input_scale, per_tensor=s.activations == "tensor")
    if kernel == "fp8":
        from batchrun.kernels.fp8_gemm import fp8_gemm
        return fp8_gemm(xq, xs, linear.weight, linear.weight_scale, linear.bias, x.dtype, s.block)
    if kernel is not None:
        raise ValueError(f"unknown FP8 GEMM kernel {kernel!r}: fp8 or None")
    y = torch._scaled_mm(xq, linear.weight.t(), scale_a=xs.expand(xq.shape[0], 1),
                         scale_b=linear.weight_scale.view(1, -1), out_dtype=x.dtype)
    return y if linear.bias is None else y + linear.bias


def scaled_mm_takes(dtype: torch.dtype, n: int, k: int, block) -> bool:
    """Whether torch._scaled_mm runs a projection: row-wise scales need a bf16 output, and
    both dimensions multiples of 16; block scales go to the Triton GEMM."""
    return block is None and dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
