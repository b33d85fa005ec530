"""The skinny-GEMM experiment (benchmarks/skinny_gemm.py) computes x @ W.T: against torch over
odd shapes (M below 16, N and K not multiples of the tiles), fresh random inputs, under the
Triton interpreter on CPU (fp32 and fp16) and in bf16 on a GPU."""
import pytest
import torch

from benchmarks.skinny_gemm import CONFIGS, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (8, 50, 70), (13, 33, 300), (16, 64, 128)])
def test_matches_torch(M, N, K, dtype):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = torch.randn(N, K, generator=g).to(DEVICE, dtype)
    got = skinny_gemm(x, w, config=(16, 64, 2, 4))
    ref = (x.float() @ w.float().t())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == (M, N)
    assert torch.allclose(got.float(), ref, atol=tol * K ** 0.5, rtol=tol)


def test_refuses_more_than_16_rows():
    x, w = torch.randn(17, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="M <= 16"):
        skinny_gemm(x.to(DEVICE), w.to(DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", CONFIGS)
def test_bf16_gpu_7b_shapes(config):
    g = torch.Generator().manual_seed(1)
    for n, k in [(4096, 4096), (4096, 11008), (100, 4096)]:
        x = torch.randn(8, k, generator=g).cuda().bfloat16()
        w = (torch.randn(n, k, generator=g) * 0.02).cuda().bfloat16()
        got = skinny_gemm(x, w, config=config).float()
        ref = x.float() @ w.float().t()
        assert (got - ref).abs().max() <= 0.01 * ref.abs().max() + 1e-3
