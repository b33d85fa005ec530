"""RMSNorm with the next projection's LoRA shrink (kernels/rms_norm_shrink.py, reached through
rms_norm / fused_add_rms_norm's `shrink=`) against the torch references: the normed rows equal the
plain norm's, the residual is updated as without the shrink, and the shrink of each row's own
slot is rnd(normed . A) while every other column, and every column of a row without an adapter,
is left as it was. A is a strided view of slot-major rows, as a LoRALinear stores it; the three
launch forms are covered: plain norm (several programs a row), residual add (several programs a
row, the sum to a new residual tensor) and a pending LoRA delta of the projection before (delta
kernel, then the norm). Both norm formulas: offset 0 (Llama) and offset 1 (Gemma, whose normed rows
are rounded after the (1 + w) scale); the shrink is of the normed rows either way."""
import pytest
import torch

from batchrun.kernels.fused_add_rms_norm import fused_add_rms_norm, rms_norm
from batchrun.kernels.lora_meta import LoRADelta, LoRAShrink
from batchrun.kernels.reference import ref_lora_shrink_rows
from kernel_testutils import CPU_DTYPES, DEVICE, POISON, mixed_slots, randn, rounding_tol

EPS = 1e-5


def _lora_a(H, S, L, R, dtype, gen, rows_above=7):
    # [S, L, R, H] view of slot-major rows under `rows_above` other rows (LoRALinear's layout)
    full = randn(rows_above + L * S * R, H, dtype=dtype, gen=gen, scale=H ** -0.5)
    return full[rows_above:].view(L, S, R, H).transpose(0, 1)


def _slots(T, k, gen, pattern):
    if pattern == "one":
        s = torch.full((T,), k - 1, dtype=torch.int32)
    elif pattern == "none":
        s = torch.full((T,), -1, dtype=torch.int32)
    else:
        s = mixed_slots(T, k, gen)
    return torch.cat([s, torch.zeros(3, dtype=torch.int32)]).to(DEVICE)  # a buffer >= T


def _check(T, H, S, L, R, k, dtype, pattern, form, seed, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = randn(T, H + 5, dtype=dtype, gen=gen)[:, :H]                   # strided rows
    res = randn(T, H, dtype=dtype, gen=gen, scale=4.0)
    w = (randn(H, dtype=dtype, gen=gen, scale=0.5) + (1 - offset)).to(dtype)   # scale ~ 1
    a = _lora_a(H, S, L, R, dtype, gen)
    slots = _slots(T, k, gen, pattern)
    shrunk = torch.full((T, k * S * R), POISON, dtype=dtype, device=DEVICE)
    shrink = LoRAShrink(a, slots, shrunk)
    if form == "norm":
        got = rms_norm(x, w, EPS, shrink=shrink, offset=offset)
        plain = rms_norm(x, w, EPS, offset=offset)
    elif form == "add":
        res2, res0 = res.clone(), res.clone()
        got, got_res = fused_add_rms_norm(x, res, w, EPS, shrink=shrink, offset=offset)
        plain, _ = fused_add_rms_norm(x, res2, w, EPS, offset=offset)
        # the sum goes to a new residual (the row's programs share the old one)
        assert got_res is not res and torch.equal(got_res, res2) and torch.equal(res, res0)
    else:  # "delta": o_proj's pending LoRA delta, added before the residual add and the norm
        b = randn(L, H, R, dtype=dtype, gen=gen, scale=R ** -0.5)
        d_shrunk = randn(T, k * R, dtype=dtype, gen=gen)
        delta = LoRADelta(d_shrunk, b, slots, (0, H))
        res2 = res.clone()
        got, _ = fused_add_rms_norm(x, res, w, EPS, lora=delta, shrink=shrink, offset=offset)
        plain, _ = fused_add_rms_norm(x, res2, w, EPS, lora=delta, offset=offset)
        assert torch.equal(res, res2)
    # the normed rows are the plain kernel's (the same row code; on a GPU the kernels are
    # compiled apart, so the sum of squares may round an ulp apart)
    if got.is_cuda:
        assert ((got.float() - plain.float()).abs() <= 2 * torch.finfo(dtype).eps
                * plain.float().abs() + 1e-6).all()
    else:
        assert torch.equal(got, plain)
    ref = ref_lora_shrink_rows(got, a, slots, k)
    own = torch.zeros(T, k, S * R, dtype=torch.bool, device=DEVICE)
    has = (slots[:T] >= 0).nonzero().squeeze(1)
    own[has, slots[has].long()] = True
    own = own.reshape(T, k * S * R)
    bound = ref_lora_shrink_rows(got.abs(), a.abs(), slots, k).float()
    tol = rounding_tol(bound, dtype, H)
    assert ((shrunk.float() - ref.float()).abs() <= tol)[own].all()
    assert (shrunk[~own] == POISON).all()  # other slots' columns and rows without an adapter


# (T, H, S, L, R, k, slot pattern)
SHAPES = [(1, 64, 2, 1, 4, 1, "one"), (5, 130, 2, 3, 5, 3, "mixed"), (8, 256, 2, 8, 16, 8, "mixed"),
          (8, 96, 2, 8, 16, 1, "one"), (13, 200, 3, 4, 20, 2, "mixed"), (16, 64, 1, 2, 3, 2, "none"),
          (37, 100, 2, 2, 7, 2, "mixed")]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,H,S,L,R,k,pattern", SHAPES)
@pytest.mark.parametrize("form", ["norm", "add", "delta"])
def test_rms_norm_shrink(T, H, S, L, R, k, pattern, form, dtype):
    _check(T, H, S, L, R, k, dtype, pattern, form, seed=T * 100 + H + R)


# Gemma's norm (offset 1) beside the shrink: the three launch forms at a few shapes, one an odd
# hidden size
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,H,S,L,R,k,pattern", [SHAPES[1], SHAPES[3], (6, 357, 2, 3, 8, 3, "mixed")])
@pytest.mark.parametrize("form", ["norm", "add", "delta"])
def test_rms_norm_shrink_offset(T, H, S, L, R, k, pattern, form, dtype):
    _check(T, H, S, L, R, k, dtype, pattern, form, seed=T * 100 + H + R + 1, offset=1.0)


def test_bad_shrink():
    gen = torch.Generator().manual_seed(1)
    x = randn(4, 64, dtype=torch.float16, gen=gen)
    w = torch.ones(64, dtype=torch.float16, device=DEVICE)
    a = _lora_a(64, 2, 2, 4, torch.float16, gen)
    slots = _slots(4, 2, gen, "mixed")
    with pytest.raises(ValueError, match="LoRA shrink does not fit"):   # out not [T, k*S*R]
        rms_norm(x, w, EPS, shrink=LoRAShrink(a, slots, torch.empty(4, 7, dtype=torch.float16,
                                                                     device=DEVICE)))
    with pytest.raises(ValueError, match="LoRA shrink does not fit"):   # A of another width
        rms_norm(x[:, :32], w[:32], EPS, shrink=LoRAShrink(a, slots, torch.empty(
            4, 16, dtype=torch.float16, device=DEVICE)))
    # refused before any launch: a pending delta's kernel would update the residual in place
    res = randn(4, 64, dtype=torch.float16, gen=gen)
    before = res.clone()
    delta = LoRADelta(randn(4, 2 * 4, dtype=torch.float16, gen=gen),
                      randn(2, 64, 4, dtype=torch.float16, gen=gen), slots, (0, 64))
    with pytest.raises(ValueError, match="LoRA shrink does not fit"):
        fused_add_rms_norm(x, res, w, EPS, lora=delta, shrink=LoRAShrink(a, slots, torch.empty(
            4, 7, dtype=torch.float16, device=DEVICE)))
    assert torch.equal(res, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 13, 16])
@pytest.mark.parametrize("form", ["norm", "add", "delta"])
def test_bf16_gpu_7b(T, form):
    # Llama-2-7b's hidden size, gate_up's two slices, rank 16, 8 slots, bounds 1 and 8
    for k, pattern in ((1, "one"), (8, "mixed")):
        _check(T, 4096, 2, 8, 16, k, torch.bfloat16, pattern, form, seed=T + k)
        # Gemma-3-12b's hidden size and norm
        _check(T, 3840, 2, 8, 16, k, torch.bfloat16, pattern, form, seed=T + k, offset=1.0)
