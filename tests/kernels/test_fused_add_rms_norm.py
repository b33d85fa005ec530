"""RMSNorm and fused add + RMSNorm (kernels/fused_add_rms_norm.py) against the torch references,
with offset 0 (Llama: weight * rnd(n)) and offset 1 (Gemma: rnd(n * (1 + weight)) in fp32), over
odd and model hidden sizes, strided rows, and the per-head form on strided head views of a
fused qkv output."""
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


OFFSETS = pytest.mark.parametrize("offset", [0.0, 1.0])


def make(T, H, dtype, gen, row_pad=0, offset=0.0):
    # x with a padded row stride (a view of a wider buffer) when row_pad > 0; the weight is the
    # stored one: near 1 for offset 0, near 0 (scale 1 + w) for offset 1
    x = randn(T, H + row_pad, dtype=dtype, gen=gen)[:, :H]
    res = randn(T, H, dtype=dtype, gen=gen, scale=4.0)
    w = randn(H, dtype=dtype, gen=gen, scale=0.5) + (1 - offset)
    return x, res, w.to(dtype)


def close(out, ref, dtype):
    tol = ulps(dtype) * ref.float().abs() + 1e-6
    err = (out.float() - ref.float()).abs()
    assert (err <= tol).all(), err.max().item()


def cases(dtypes):
    return pytest.mark.parametrize("dtype", dtypes), pytest.mark.parametrize(
        "T,H", [(1, 64), (5, 130), (3, 1000), (7, 17)])


def _check(T, H, dtype, seed, row_pad=0, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    x, res, w = make(T, H, dtype, gen, row_pad, offset)
    out = torch.full((T, H), POISON, dtype=dtype, device=DEVICE)
    assert torch.equal(rms_norm(x, w, EPS, out=out, offset=offset), out)
    close(out, ref_rms_norm(x, w, EPS, offset), dtype)

    x_before = x.clone()
    ref_out, ref_res = ref_fused_add_rms_norm(x, res, w, EPS, offset)
    out = torch.full((T, H), POISON, dtype=dtype, device=DEVICE)
    got, got_res = fused_add_rms_norm(x, res, w, EPS, out=out, offset=offset)
    assert got is out and got_res is res                  # residual updated in place
    assert torch.equal(res, ref_res)                      # the add is exact per dtype
    assert torch.equal(x, x_before)
    close(out, ref_out, dtype)
    got2, _ = fused_add_rms_norm(x.clone(), ref_res.clone() - x, w, EPS, offset=offset)
    assert got2.shape == (T, H) and not got2.isnan().any()   # fresh output


@OFFSETS
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (5, 130), (3, 1000), (7, 17), (2, 3584), (3, 3840),
                                 (1, 5120), (2, 2305)])
def test_rms_norm(T, H, dtype, offset):
    _check(T, H, dtype, seed=T * 1000 + H, offset=offset)


@OFFSETS
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_strided_rows(dtype, offset):
    _check(4, 130, dtype, seed=7, row_pad=6, offset=offset)


def test_offset_changes_the_formula():
    # offset 1 is not weight + 1 under the Llama formula: Gemma casts after the scale
    gen = torch.Generator().manual_seed(8)
    x, _, w = make(5, 200, torch.float16, gen, offset=1.0)
    gemma = rms_norm(x, w, EPS, offset=1.0)
    assert torch.equal(gemma, ref_rms_norm(x, w, EPS, 1.0)) or gemma.is_cuda
    xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.equal(ref_rms_norm(x, w, EPS, 1.0), (xf * (1.0 + w.float())).to(x.dtype))
    llama_form = ref_rms_norm(x, (w.float() + 1).to(w.dtype), EPS)
    assert not torch.equal(gemma, llama_form)
    assert (gemma.float() - llama_form.float()).abs().max() < 0.05     # the same norm, roughly


def _heads(T, H, D, dtype, gen, layout):
    # a [T, H, D] view: "qkv" the q and k heads of a fused qkv output row (row stride past
    # H * D, plus padding), "transposed" a head-major buffer seen token-major
    if layout == "qkv":
        buf = randn(T, 3 * H * D + 5, dtype=dtype, gen=gen)
        return buf, buf[:, H * D:2 * H * D].view(T, H, D)
    buf = randn(H, T, D, dtype=dtype, gen=gen)
    return buf, buf.transpose(0, 1)


@OFFSETS
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,H,D", [(1, 8, 256), (5, 4, 128), (3, 2, 80), (9, 3, 37)])
@pytest.mark.parametrize("layout", ["qkv", "transposed"])
def test_per_head_norm(T, H, D, dtype, offset, layout):
    gen = torch.Generator().manual_seed(T * 100 + D)
    buf, x = _heads(T, H, D, dtype, gen, layout)
    assert T == 1 or not x.is_contiguous()       # (one row counts as contiguous)
    w = (randn(D, dtype=dtype, gen=gen, scale=0.5) + (1 - offset)).to(dtype)
    before = buf.clone()
    got = rms_norm(x, w, EPS, offset=offset)
    assert torch.equal(buf, before)                       # the qkv output is not written
    ref = ref_rms_norm(x, w, EPS, offset)
    assert got.shape == (T, H, D) and got.dtype == ref.dtype
    close(got, ref, dtype)
    # each head is the 2-D norm of its rows
    for h in range(H):
        assert torch.equal(got[:, h], rms_norm(x[:, h], w, EPS, offset=offset)) or got.is_cuda
    out = torch.full((T, H, D), POISON, dtype=dtype, device=DEVICE)
    assert rms_norm(x, w, EPS, out=out, offset=offset) is out and torch.equal(out, got)


def test_per_head_norm_bad_args():
    gen = torch.Generator().manual_seed(4)
    _, x = _heads(3, 2, 64, torch.float16, gen, "qkv")
    w = torch.ones(64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, w[:32], EPS)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(x.transpose(1, 2), w[:2], EPS)
    with pytest.raises(ValueError):
        fused_add_rms_norm(x, x.clone(), w, EPS)          # no residual add per head
    assert rms_norm(x[:0], w, EPS).shape == (0, 2, 64)


def test_fp32_weight_promotes():
    gen = torch.Generator().manual_seed(3)
    x, res, _ = make(3, 64, torch.float16, gen)
    w = randn(64, dtype=torch.float32, gen=gen)
    out = rms_norm(x, w, EPS)
    assert out.dtype == torch.float32
    close(out, ref_rms_norm(x, w, EPS), torch.float16)


def test_offset_output_has_x_dtype():
    # Gemma's `.type_as(x)`: an fp32 weight does not promote the output
    gen = torch.Generator().manual_seed(3)
    x, res, _ = make(3, 64, torch.float16, gen)
    w = randn(64, dtype=torch.float32, gen=gen, scale=0.3)
    out = rms_norm(x, w, EPS, offset=1.0)
    assert out.dtype == torch.float16
    close(out, ref_rms_norm(x, w, EPS, 1.0), torch.float16)
    got, _ = fused_add_rms_norm(x, res.clone(), w, EPS, offset=1.0)
    assert got.dtype == torch.float16
    close(got, ref_fused_add_rms_norm(x, res, w, EPS, 1.0)[0], torch.float16)


def test_empty_and_bad_args():
    w = torch.ones(64, device=DEVICE)
    assert rms_norm(torch.empty(0, 64, device=DEVICE), w, EPS).shape == (0, 64)
    with pytest.raises(ValueError):
        rms_norm(torch.ones(2, 32, device=DEVICE), w, EPS)
    with pytest.raises(ValueError):
        fused_add_rms_norm(torch.ones(2, 64, device=DEVICE), torch.ones(3, 64, device=DEVICE), w, EPS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@OFFSETS
@pytest.mark.parametrize("T", [1, 8, 77, 256])
@pytest.mark.parametrize("H", [3584, 3840, 4096, 5120, 5376])
def test_bf16_gpu(T, H, offset):
    _check(T, H, torch.bfloat16, seed=T + H, offset=offset)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@OFFSETS
@pytest.mark.parametrize("T", [1, 77, 4096])
@pytest.mark.parametrize("H,D", [(16, 256), (32, 128), (8, 256)])
def test_bf16_gpu_per_head(T, H, D, offset):
    gen = torch.Generator().manual_seed(T + H)
    _, x = _heads(T, H, D, torch.bfloat16, gen, "qkv")
    w = (randn(D, dtype=torch.bfloat16, gen=gen, scale=0.5) + (1 - offset)).to(torch.bfloat16)
    close(rms_norm(x, w, EPS, offset=offset), ref_rms_norm(x, w, EPS, offset), torch.bfloat16)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="bit-exactness needs the interpreter's IEEE rsqrt; on a GPU rsqrt is "
                           "approximate (the GPU tests bound the error instead)")
@OFFSETS
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_op_order_exact(dtype, offset):
    # Inputs on a coarse grid make the sum of squares exact in any order, so the kernel must
    # then match the reference bit for bit: this pins HF's op order (offset 0: cast to the
    # dtype BEFORE the weight multiply; offset 1: (1 + w) in fp32 and the cast AFTER it; the
    # add in the model dtype).
    gen = torch.Generator().manual_seed(1)
    T, H = 6, 200
    grid = lambda *s: (torch.randint(-64, 65, s, generator=gen) / 8).to(dtype=dtype, device=DEVICE)
    x, res = grid(T, H), grid(T, H)
    w = (torch.rand(H, generator=gen) + 0.5 - offset).to(dtype=dtype, device=DEVICE)
    assert torch.equal(rms_norm(x, w, EPS, offset=offset), ref_rms_norm(x, w, EPS, offset))
    ref_out, ref_res = ref_fused_add_rms_norm(x, res, w, EPS, offset)
    out, res = fused_add_rms_norm(x, res, w, EPS, offset=offset)
    assert torch.equal(res, ref_res) and torch.equal(out, ref_out)
    heads = x.view(T, 8, 25)[:, 1:7]                        # the per-head form, strided heads
    assert torch.equal(rms_norm(heads, w[:25], EPS, offset=offset),
                       ref_rms_norm(heads, w[:25], EPS, offset))
