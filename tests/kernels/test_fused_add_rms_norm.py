import pytest
import torch

from batchrun.kernels.fused_add_rms_norm import fused_add_rms_norm, rms_norm
from batchrun.kernels.reference import ref_fused_add_rms_norm, ref_rms_norm
from kernel_testutils import CPU_DTYPES, DEVICE, POISON, randn

EPS = 1e-5


def ulps(dtype):
    # fp32: sum-of-squares order differs (few ulps of the normalised value); fp16/bf16: the
    # cast before the weight may flip one ulp, the product rounds once more.
    return 16 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


def make(T, H, dtype, gen, row_pad=0):
    # x with a padded row stride (a view of a wider buffer) when row_pad > 0
    x = randn(T, H + row_pad, dtype=dtype, gen=gen)[:, :H]
    res = randn(T, H, dtype=dtype, gen=gen, scale=4.0)
    w = randn(H, dtype=dtype, gen=gen, scale=0.5) + 1
    return x, res, w.to(dtype)


def close(out, ref, dtype):
    tol = ulps(dtype) * ref.float().abs() + 1e-6
    err = (out.float() - ref.float()).abs()
    assert (err <= tol).all(), err.max().item()


def cases(dtypes):
    return pytest.mark.parametrize("dtype", dtypes), pytest.mark.parametrize(
        "T,H", [(1, 64), (5, 130), (3, 1000), (7, 17)])


def _check(T, H, dtype, seed, row_pad=0):
    gen = torch.Generator().manual_seed(seed)
    x, res, w = make(T, H, dtype, gen, row_pad)
    out = torch.full((T, H), POISON, dtype=dtype, device=DEVICE)
    assert torch.equal(rms_norm(x, w, EPS, out=out), out)
    close(out, ref_rms_norm(x, w, EPS), dtype)

    x_before = x.clone()
    ref_out, ref_res = ref_fused_add_rms_norm(x, res, w, EPS)
    out = torch.full((T, H), POISON, dtype=dtype, device=DEVICE)
    got, got_res = fused_add_rms_norm(x, res, w, EPS, out=out)
    assert got is out and got_res is res                  # residual updated in place
    assert torch.equal(res, ref_res)                      # the add is exact per dtype
    assert torch.equal(x, x_before)
    close(out, ref_out, dtype)
    got2, _ = fused_add_rms_norm(x.clone(), ref_res.clone() - x, w, EPS)   # fresh output
    assert got2.shape == (T, H) and not got2.isnan().any()


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 130), (3, 1000), (7, 17)])
def test_rms_norm(T, H, dtype):
    _check(T, H, dtype, seed=T * 1000 + H)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_strided_rows(dtype):
    _check(4, 130, dtype, seed=7, row_pad=6)


def test_fp32_weight_promotes():
    gen = torch.Generator().manual_seed(3)
    x, res, _ = make(3, 64, torch.float16, gen)
    w = randn(64, dtype=torch.float32, gen=gen)
    out = rms_norm(x, w, EPS)
    assert out.dtype == torch.float32
    close(out, ref_rms_norm(x, w, EPS), torch.float16)


def test_empty_and_bad_args():
    w = torch.ones(64, device=DEVICE)
    assert rms_norm(torch.empty(0, 64, device=DEVICE), w, EPS).shape == (0, 64)
    with pytest.raises(ValueError):
        rms_norm(torch.ones(2, 32, device=DEVICE), w, EPS)
    with pytest.raises(ValueError):
        fused_add_rms_norm(torch.ones(2, 64, device=DEVICE), torch.ones(3, 64, device=DEVICE), w, EPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("H", [4096, 5120])
def test_bf16_gpu(T, H):
    _check(T, H, torch.bfloat16, seed=T + H)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="bit-exactness needs the interpreter's IEEE rsqrt; on a GPU rsqrt is "
                           "approximate (the GPU tests bound the error instead)")
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_op_order_exact(dtype):
    # Inputs on a coarse grid make the sum of squares exact in any order, so the kernel must
    # then match the reference bit for bit: this pins HF's op order (cast to the dtype BEFORE
    # the weight multiply, add in the model dtype).
    gen = torch.Generator().manual_seed(1)
    T, H = 6, 200
    grid = lambda *s: (torch.randint(-64, 65, s, generator=gen) / 8).to(dtype=dtype, device=DEVICE)
    x, res = grid(T, H), grid(T, H)
    w = (torch.rand(H, generator=gen) + 0.5).to(dtype=dtype, device=DEVICE)
    assert torch.equal(rms_norm(x, w, EPS), ref_rms_norm(x, w, EPS))
    ref_out, ref_res = ref_fused_add_rms_norm(x, res, w, EPS)
    out, res = fused_add_rms_norm(x, res, w, EPS)
    assert torch.equal(res, ref_res) and torch.equal(out, ref_out)
