"""kernels/fp8_gemm.py (the scaled FP8 GEMM) against the dequantized reference, row-wise and
block-scaled, both tilings (M <= 16 and larger), odd shapes, bias, fresh random inputs: under the
Triton interpreter on CPU (fp32 and fp16 outputs) and in bf16 on a GPU at Llama-3-8B shapes;
and kernels/fp8_quant.py (GPU only: the interpreter here rounds fp32 -> e4m3 wrongly where the
mantissa carries into the exponent, e.g. 126.05 -> 64)."""
import pytest
import torch

from batchrun.kernels.fp8_gemm import fp8_gemm
from batchrun.kernels.reference import ref_dequant_fp8, ref_quant_fp8
from kernel_testutils import DEVICE, randn

FP8 = torch.float8_e4m3fn
SHAPES = [(1, 16, 32), (5, 70, 300), (16, 64, 256), (17, 33, 130), (70, 200, 96)]


def _operands(M, N, K, block, seed):
    g = torch.Generator().manual_seed(seed)
    x = randn(M, K, dtype=torch.float32, gen=g, device="cpu")
    w = randn(N, K, dtype=torch.float32, gen=g, device="cpu")
    if block is None:
        xq, xs = ref_quant_fp8(x)
        ws = (w.abs().amax(1) / 448) * (0.5 + torch.rand(N, generator=g))  # some values clamp
    else:
        xq, xs = ref_quant_fp8(x, group=block[1])
        ws = torch.rand(-(-N // block[0]), -(-K // block[1]), generator=g) + 0.01
    wq = (w / (w.abs().amax(1, keepdim=True) / 448)).clamp(-448, 448).to(FP8)
    bias = randn(N, dtype=torch.float32, gen=g, device="cpu")
    ref = ref_dequant_fp8(xq, xs, None if block is None else (1, block[1])) \
        @ ref_dequant_fp8(wq, ws, block).t()
    return [t.to(DEVICE) for t in (xq, xs, wq, ws, bias)], ref.to(DEVICE)


def _close(y, ref, bias, dtype, K):
    want = ref + (0 if bias is None else bias)
    tol = 1e-5 * K ** 0.5 * want.abs().max() + (torch.finfo(dtype).eps * want.abs() if dtype != torch.float32 else 0)
    assert ((y.float() - want).abs() <= tol).all(), (y.float() - want).abs().max().item()


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("block", [None, (32, 32), (16, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_gemm_matches_the_dequantized_reference(M, N, K, block, dtype):
    (xq, xs, wq, ws, bias), ref = _operands(M, N, K, block, seed=M * 7 + N + K)
    use_bias = M % 2 == 1
    y = fp8_gemm(xq, xs, wq, ws, bias if use_bias else None, dtype, block)
    assert y.dtype == dtype and y.shape == (M, N)
    _close(y, ref, bias if use_bias else None, dtype, K)


def test_fp8_gemm_refuses_bad_scales():
    (xq, xs, wq, ws, _), _ = _operands(4, 32, 64, None, 1)
    with pytest.raises(ValueError, match=r"row-wise scales must be \[4, 1\] and \[32\]"):
        fp8_gemm(xq, xs.view(-1), wq, ws, None, torch.float16)
    with pytest.raises(ValueError, match="block scales must be"):
        fp8_gemm(xq, xs, wq, ws, None, torch.float16, (32, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 16, 256, 1000])
@pytest.mark.parametrize("N,K,block", [(6144, 4096, None), (4096, 14336, None), (28672, 4096, None),
                                      (6144, 4096, (128, 128)), (4096, 14336, (128, 128))])
def test_fp8_gemm_bf16_at_8b_shapes(M, N, K, block):
    (xq, xs, wq, ws, bias), ref = _operands(M, N, K, block, seed=M + N)
    y = fp8_gemm(xq, xs, wq, ws, bias.bfloat16(), torch.bfloat16, block)
    _close(y, ref, bias.bfloat16().float(), torch.bfloat16, K)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(1, 4096), (7, 300), (300, 14336), (33, 96)])
@pytest.mark.parametrize("mode", ["token", "group", "static", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quant_fp8_matches_the_reference(M, K, mode, dtype):
    from batchrun.kernels.fp8_quant import quant_fp8
    g = torch.Generator().manual_seed(M + K)
    x = randn(M, K, dtype=dtype, gen=g, scale=3.0)
    x[0, : min(K, 5)] = 0  # part of a row at zero; the floor keeps the scale positive
    if mode == "group":
        q, s = quant_fp8(x, group=128)
        rq, rs = ref_quant_fp8(x, group=128)
    elif mode == "static":
        scale = torch.tensor([0.01], device=DEVICE)
        q, s = quant_fp8(x, scale=scale)
        rq, rs = ref_quant_fp8(x, scale=scale)
        rs = rs.expand(M, 1)
    elif mode == "tensor":
        q, s = quant_fp8(x, per_tensor=True)
        rq, rs = ref_quant_fp8(x, scale=(x.float().abs().amax() / 448).reshape(1))
        rs = rs.expand(M, 1)
    else:
        q, s = quant_fp8(x)
        rq, rs = ref_quant_fp8(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    # the same e4m3 values, but where x / scale lands within an fp32 ulp of a rounding tie
    diff = (q.float() != rq.float())
    assert diff.float().mean() < 1e-3, diff.sum().item()
