"""The LoRA delta fused into the kernels after each projection (RMSNorm with either offset,
act-and-mul with either activation, rotary) against the torch reference: op(apply_reference(x)).
Inputs are laid out like a fused decode step: y and `shrunk` are column ranges of one GEMM output
(strided rows), slots mix -1 with every slot, ranks are odd and small. Rows with slot -1 must
equal the plain kernel bit for bit.

The kernels work on tiles of token rows (kernels/lora_delta.py: 16 to 32 rows; steps of at most
GATHER_MAX_ROWS rows gather each row's B instead, test_both_delta_forms runs both), so the shapes
also cover several tiles, a last tile cut short, tiles whose rows all share one slot (the
highest, so the slot range does not start at 0), rows sorted by slot, and ranks below, at and
above the 16-rank dot minimum.
"""
import pytest
import torch

from batchrun.kernels.act_and_mul import ACTIVATIONS, act_and_mul
from batchrun.kernels.fused_add_rms_norm import fused_add_rms_norm, rms_norm
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.reference import (ref_act_and_mul, ref_fused_add_rms_norm, ref_rms_norm,
                                        ref_rotary)
from batchrun.kernels.rotary import apply_rotary
from kernel_testutils import CPU_DTYPES, DEVICE, mixed_slots, randn
from test_rotary import cos_sin_cache


def _slots(T, L, gen, pattern):
    # int32 [T]: "mixed" (-1 and every slot, shuffled), "sorted" (the same, grouped by slot),
    # "one" (every row the highest slot), "none" (every row -1), "gaps" (-1, the lowest and the
    # highest slot only: the slot loop passes slots no row uses)
    if pattern == "gaps":
        return torch.tensor([-1, 0, L - 1], dtype=torch.int32)[
            torch.randint(0, 3, (T,), generator=gen)]
    if pattern == "one":
        return torch.full((T,), L - 1, dtype=torch.int32)
    if pattern == "none":
        return torch.full((T,), -1, dtype=torch.int32)
    slots = mixed_slots(T, L, gen)
    return slots.sort().values if pattern == "sorted" else slots


def _fused_output(T, sizes, L, R, dtype, seed, pattern="mixed", k=None):
    """(y [T, N] view, LoRADelta, slots) as a fused LoRA GEMM leaves them: a GEMM over the
    first k <= L slots' A rows (the step's slot bound; every slot < k), B of all L slots."""
    gen = torch.Generator().manual_seed(seed)
    N, S, k = sum(sizes), len(sizes), L if k is None else k
    full = randn(T, N + S * k * R + 3, dtype=dtype, gen=gen)  # +3: rows are strided
    slots = torch.cat([_slots(T, k, gen, pattern), torch.randint(0, k, (5,), generator=gen,
                                                                 dtype=torch.int32)]).to(DEVICE)
    lora_b = randn(L, N, R, dtype=dtype, gen=gen, scale=R ** -0.5)
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + n)
    delta = LoRADelta(full[:, N:N + S * k * R], lora_b, slots, tuple(offs))
    assert delta.num_slots == k
    return full[:, :N], delta, slots[:T]


def _tol(ref, dtype, scale):
    # the kernel and the reference sum the R products in different orders, so x + delta may
    # round one ulp apart; the op carries that through (bounded by eps * scale)
    eps = torch.finfo(dtype).eps
    return 4 * eps * (ref.float().abs() + scale) + 1e-6


def _same_where_no_lora(got, plain, slots):
    # rows without an adapter get a zero delta: the plain kernel's values (on a GPU the LoRA
    # variant is compiled differently, so sums may round apart by an ulp; not under the
    # interpreter)
    none = (slots < 0).nonzero().squeeze(1)
    if got.is_cuda:
        eps = torch.finfo(got.dtype).eps
        tol = 2 * eps * (plain[none].float().abs() + plain[none].float().abs().mean()) + 1e-6
        assert ((got[none].float() - plain[none].float()).abs() <= tol).all()
    else:
        assert torch.equal(got[none], plain[none])


# (T, H, L, R, slot pattern): several row tiles, the last one short
NORM_TILES = [(37, 96, 3, 5, "mixed"), (50, 200, 8, 16, "mixed"), (33, 128, 4, 20, "one"),
              (40, 64, 2, 3, "sorted"), (17, 130, 2, 4, "none"), (45, 96, 6, 8, "gaps")]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,H,L,R", [(1, 64, 1, 16), (7, 96, 3, 5), (5, 300, 4, 8), (9, 128, 2, 1),
                                     pytest.param(8, 4096, 8, 16, marks=pytest.mark.slow)])  # a 7b decode step's norm
@pytest.mark.parametrize("fused_add", [True, False])
@pytest.mark.parametrize("offset", [0.0, 1.0])  # Llama's norm, Gemma's
def test_norm(T, H, L, R, dtype, fused_add, offset, pattern="mixed"):
    _check_norm(T, H, L, R, dtype, fused_add, pattern, offset=offset)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,H,L,R,pattern", NORM_TILES)
@pytest.mark.parametrize("fused_add", [True, False])
def test_norm_tiles(T, H, L, R, pattern, dtype, fused_add):
    _check_norm(T, H, L, R, dtype, fused_add, pattern)


def _check_norm(T, H, L, R, dtype, fused_add, pattern, k=None, offset=0.0):
    x, delta, slots = _fused_output(T, [H], L, R, dtype, seed=T * 31 + H + R, pattern=pattern,
                                    k=k)
    gen = torch.Generator().manual_seed(7)
    w = randn(H, dtype=dtype, gen=gen)
    x_before = x.clone()
    fixed = delta.apply_reference(x)
    if fused_add:
        res = randn(T, H, dtype=dtype, gen=gen)
        res_plain, res_before = res.clone(), res.clone()
        out, res_out = fused_add_rms_norm(x, res, w, 1e-6, lora=delta, offset=offset)
        ref, ref_res = ref_fused_add_rms_norm(fixed, res_before, w, 1e-6, offset)
        plain, _ = fused_add_rms_norm(x, res_plain, w, 1e-6, offset=offset)
        assert res_out is res
        # rnd(x + delta) may be an ulp apart (see _tol): an ulp of that sum, not of the
        # residual, which can be far smaller where the two cancel
        assert (res.float() - ref_res.float()).abs().le(_tol(ref_res, dtype, fixed.float().abs())).all()
        _same_where_no_lora(res, res_plain, slots)
    else:
        out = rms_norm(x, w, 1e-6, lora=delta, offset=offset)
        ref, plain = ref_rms_norm(fixed, w, 1e-6, offset), rms_norm(x, w, 1e-6, offset=offset)
        # deterministic: the same result twice
        assert torch.equal(rms_norm(x, w, 1e-6, lora=delta, offset=offset), out)
    assert torch.equal(x, x_before)  # the projection output itself is not written
    scale = ref.float().abs().mean(-1, keepdim=True)
    assert (out.float() - ref.float()).abs().le(_tol(ref, dtype, scale)).all()
    _same_where_no_lora(out, plain, slots)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,I,L,R", [(1, 64, 1, 16), (6, 130, 3, 7), (4, 600, 2, 4)])
def test_act_and_mul(T, I, L, R, dtype, activation, pattern="mixed"):
    _check_act(T, I, L, R, dtype, pattern, activation=activation)


# (T, I, L, R, slot pattern): several row tiles of 32, the last one short; column tiles of
# 64, the last one short; 12 slots
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,I,L,R,pattern", [(70, 100, 8, 16, "mixed"), (29, 72, 3, 5, "one"),
                                             (66, 40, 4, 20, "sorted"), (20, 64, 2, 1, "mixed"),
                                             (40, 48, 12, 4, "mixed"), (50, 70, 5, 8, "gaps")])
def test_act_and_mul_tiles(T, I, L, R, pattern, dtype, activation):
    _check_act(T, I, L, R, dtype, pattern, activation=activation)


def _check_act(T, I, L, R, dtype, pattern, k=None, activation="silu"):
    gate_up, delta, slots = _fused_output(T, [I, I], L, R, dtype, seed=T + I + R, pattern=pattern,
                                          k=k)
    before = gate_up.clone()
    out = act_and_mul(gate_up, activation, lora=delta)
    ref = ref_act_and_mul(delta.apply_reference(gate_up), activation)
    assert torch.equal(gate_up, before)
    scale = ref.float().abs().mean(-1, keepdim=True)
    assert (out.float() - ref.float()).abs().le(_tol(ref, dtype, scale)).all()
    _same_where_no_lora(out, act_and_mul(gate_up, activation), slots)


def _check_rotary(T, Hq, Hkv, D, L, R, dtype, seed, pattern="mixed", k=None, rot=None):
    # R: the LoRA rank; rot: the rotary dim (the table's width, D unless given): the delta
    # reaches all D dims, only the first rot rotate
    qkv, delta, slots = _fused_output(T, [Hq * D, Hkv * D, Hkv * D], L, R, dtype, seed, pattern,
                                      k=k)
    plain_qkv = qkv.clone()
    fixed = delta.apply_reference(qkv)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    fq, fk, fv = (t.view(T, -1, D) for t in fixed.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 256, (T,), generator=gen).to(DEVICE)
    rot = D if rot is None else rot
    cs = cos_sin_cache(rot, 256)
    apply_rotary(q, k, cs, positions, v=v, lora=delta)
    for got, ref in ((q, ref_rotary(fq, cs, positions)), (k, ref_rotary(fk, cs, positions)),
                     (v, fv)):
        # a rotated element mixes both halves of the rotary dims: bound by the pair's magnitude
        pair = ref.float().abs()
        pair[..., :rot] += pair[..., :rot].roll(rot // 2, dims=-1)
        assert (got.float() - ref.float()).abs().le(_tol(ref, dtype, pair)).all()
    pq, pk, _ = (t.view(T, -1, D) for t in plain_qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    apply_rotary(pq, pk, cs, positions)
    _same_where_no_lora(qkv, plain_qkv, slots)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D,L,R", [(1, 4, 4, 32, 1, 16), (6, 8, 2, 64, 3, 5),
                                            (5, 6, 1, 80, 2, 8)])
def test_rotary(T, Hq, Hkv, D, L, R, dtype):
    _check_rotary(T, Hq, Hkv, D, L, R, dtype, seed=T + Hq + D)


# Partial rotary (T, Hq, Hkv, D, rotary dim, L, R): Phi-4-mini's 96 of 128 over two row tiles,
# half of 96, and R/2 = 15 (odd) of 80
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D,rot,L,R", [(20, 6, 2, 128, 96, 3, 5), (6, 8, 2, 96, 48, 2, 16),
                                                (5, 6, 1, 80, 30, 2, 8)])
def test_rotary_partial(T, Hq, Hkv, D, rot, L, R, dtype):
    _check_rotary(T, Hq, Hkv, D, L, R, dtype, seed=T + Hq + D + rot, rot=rot)


# (T, Hq, Hkv, D, L, R, slot pattern): GQA and MHA over several row tiles; D = 80 pads the
# half-head dims (40 of 64); D = 16 puts two heads in one tile of 16 columns
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,D,L,R,pattern", [pytest.param(70, 4, 2, 64, 8, 16, "mixed", marks=pytest.mark.slow),
                                                    (37, 6, 1, 80, 3, 5, "sorted"),
                                                    (21, 3, 3, 16, 2, 20, "one"),
                                                    (18, 4, 2, 32, 4, 3, "none"),
                                                    (40, 4, 2, 32, 6, 8, "gaps")])
def test_rotary_tiles(T, Hq, Hkv, D, L, R, pattern, dtype):
    _check_rotary(T, Hq, Hkv, D, L, R, dtype, seed=T + Hq + D, pattern=pattern)


# Both ways of adding the delta over the same shapes: the slot loop over 16-32-row tiles
# (GATHER_MAX_ROWS = 0) and the per-row B gathers (every step a GATHER step), whatever size
# the engine would pick for them; small and tiled row counts, one and many slots, rank chunks.
BOTH_FORMS = [(3, "mixed", 5), (8, "mixed", 16), (8, "one", 3), (20, "sorted", 20), (37, "gaps", 8)]


@pytest.mark.parametrize("gather_max_rows", [0, 10 ** 6], ids=["slot-loop", "gather"])
@pytest.mark.parametrize("T,pattern,R", BOTH_FORMS)
def test_both_delta_forms(T, pattern, R, gather_max_rows, monkeypatch):
    from batchrun.kernels import lora_delta
    monkeypatch.setattr(lora_delta, "GATHER_MAX_ROWS", gather_max_rows)
    dtype = CPU_DTYPES[0]
    _check_norm(T, 96, 8, R, dtype, fused_add=True, pattern=pattern)
    _check_norm(T, 40, 8, R, dtype, fused_add=False, pattern=pattern, offset=1.0)
    _check_act(T, 72, 8, R, dtype, pattern)
    _check_act(T, 40, 8, R, dtype, pattern, activation="gelu_tanh")
    _check_rotary(T, 4, 2, 32, 8, R, dtype, seed=T + R, pattern=pattern)


# A step whose slots are all below k < L: its GEMM computed only the first k slots' shrunk
# values (slot-major columns), while B holds all L slots. Both delta forms, one and several
# slots present.
@pytest.mark.parametrize("gather_max_rows", [0, 10 ** 6], ids=["slot-loop", "gather"])
@pytest.mark.parametrize("T,k,pattern", [(5, 1, "one"), (8, 2, "mixed"), (37, 4, "gaps")])
def test_slot_bound_below_the_slot_count(T, k, pattern, gather_max_rows, monkeypatch):
    from batchrun.kernels import lora_delta
    monkeypatch.setattr(lora_delta, "GATHER_MAX_ROWS", gather_max_rows)
    dtype = CPU_DTYPES[0]
    _check_norm(T, 96, 8, 16, dtype, fused_add=True, pattern=pattern, k=k)
    _check_act(T, 72, 8, 5, dtype, pattern, k=k)
    _check_act(T, 40, 8, 5, dtype, pattern, k=k, activation="gelu_tanh")
    _check_rotary(T, 4, 2, 32, 8, 8, dtype, seed=T + k, pattern=pattern, k=k)


def test_shrunk_and_b_of_different_dtypes_dot_in_fp32():
    # fp32 shrunk values with fp16 B and y: both operands go to the dot as fp32
    T, I, L, R = 20, 48, 3, 6
    gate_up, delta, slots = _fused_output(T, [I, I], L, R, torch.float16, seed=5)
    wide = LoRADelta(delta.shrunk.float(), delta.lora_b, delta.token_slots, delta.slice_offsets)
    out = act_and_mul(gate_up, lora=wide)
    ref = ref_act_and_mul(wide.apply_reference(gate_up))
    scale = ref.float().abs().mean(-1, keepdim=True)
    assert (out.float() - ref.float()).abs().le(_tol(ref, torch.float16, scale)).all()
    _same_where_no_lora(out, act_and_mul(gate_up), slots)


def test_rotary_refuses_a_delta_of_another_layout():
    qkv, delta, _ = _fused_output(2, [64, 32, 32], 2, 4, torch.float32, seed=1)
    q, k, v = (t.view(2, -1, 16) for t in qkv.split([64, 32, 32], dim=-1))
    cs = cos_sin_cache(16, 8)
    pos = torch.zeros(2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="needs v"):
        apply_rotary(q, k, cs, pos, lora=delta)
    wrong = LoRADelta(delta.shrunk, delta.lora_b, delta.token_slots, (0, 32, 96, 128))
    with pytest.raises(ValueError, match="slice offsets"):
        apply_rotary(q, k, cs, pos, v=v, lora=wrong)


def test_norm_refuses_a_delta_of_another_size():
    x, delta, _ = _fused_output(3, [40, 40], 2, 4, torch.float32, seed=2)
    w = torch.ones(80, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        rms_norm(x, w, 1e-6, lora=delta)  # a 2-slice delta on a norm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 77])
@pytest.mark.parametrize("L,R", [(1, 16), (8, 16), (4, 64)])
def test_bf16_gpu_llama7b_shapes(T, L, R):
    dt = torch.bfloat16
    test_norm(T, 4096, L, R, dt, fused_add=True, offset=0.0)
    test_norm(T, 3840, L, R, dt, fused_add=True, offset=1.0)      # Gemma-3-12b
    test_act_and_mul(T, 11008, L, R, dt, "silu")
    test_act_and_mul(T, 15360, L, R, dt, "gelu_tanh")  # Gemma-3-12b's gate_up
    _check_rotary(T, 32, 32, 128, L, R, dt, seed=T + L)
    _check_rotary(T, 32, 8, 128, L, R, dt, seed=T + L + 1)  # GQA (Llama-3 shape)
    _check_rotary(T, 24, 8, 128, L, R, dt, seed=T + L + 2, rot=96)  # Phi-4-mini: partial rotary
