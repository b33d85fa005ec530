"""Shared input builders and tolerances for the kernel tests."""
from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 is wrong under the Triton interpreter (CPU), so CPU runs cover fp32 and fp16 only.
CPU_DTYPES = [torch.float32, torch.float16]
POISON = 1e4  # written into outputs before a run; rows the kernel must not touch keep it


def mixed_slots(T: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    # int32 [T]: a mix of -1 (no LoRA / padding) and every slot, shuffled, so groups interleave.
    base = torch.arange(T) % (num_slots + 1) - 1
    return base[torch.randperm(T, generator=gen)].to(torch.int32)


def randn(*shape, dtype, gen, scale=1.0, device=DEVICE):
    # Fresh random values (never zeros) so a kernel that skips work cannot pass by accident.
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)


def rounding_tol(ref_abs: torch.Tensor, dtype: torch.dtype, terms: int) -> torch.Tensor:
    # Elementwise bound: fp32 accumulation over `terms` products (sum-order differences,
    # ~sqrt(terms) * eps32 relative to sum |a*b|) plus one rounding to `dtype` (1 ulp).
    acc = 4 * terms ** 0.5 * torch.finfo(torch.float32).eps * ref_abs
    out = torch.finfo(dtype).eps * ref_abs if dtype != torch.float32 else 0
    return acc + out + 1e-6


def assert_gemm_close(got, x, w, bias=None) -> None:
    """A GEMM's y = x @ w.T (+ bias) vs the torch reference, within rounding_tol of sum |x*w|."""
    from batchrun.kernels.reference import ref_linear
    ref = ref_linear(x, w, bias)
    bound = x.float().abs() @ w.float().abs().t() + (0 if bias is None else bias.float().abs())
    tol = rounding_tol(bound, x.dtype, x.shape[1])
    err = (got.float() - ref.float()).abs()
    assert (err <= tol).all(), (err - tol).max().item()


def assert_attention_close(out, ref, v_cache, dtype) -> None:
    """Attention output vs its reference: no NaN left (every row written) and within rounding.
    P (rounded to the cache dtype for the PV dot) and out each round once, and |out| <= max|v|;
    fp32 gets headroom for exp2/sum-order differences."""
    import torch
    assert not out.isnan().any()
    eps = torch.finfo(dtype).eps
    vmax = v_cache.nan_to_num().abs().max().item()
    tol = (4 * eps if dtype != torch.float32 else 64 * eps) * vmax
    err = (out.float() - ref.float()).abs()
    assert err.max().item() <= tol, err.max().item()
