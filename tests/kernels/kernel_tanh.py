"""Runs the attention kernels' Triton tanh elementwise, for its accuracy test."""
import torch
import triton
import triton.language as tl

from batchrun.kernels.paged_attention import tanh


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tanh(tl.load(x_ptr + offs, mask=mask, other=0.0)), mask=mask)


def run_tanh(x: torch.Tensor) -> torch.Tensor:
    x = x.float().contiguous()
    y = torch.empty_like(x)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y
