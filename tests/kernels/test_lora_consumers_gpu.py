"""The tiled LoRA consumers (rotary, fused add + RMSNorm, SiLU-and-mul) in bf16 at Llama-2-7b
shapes on the GPU, against the torch reference: decode batches of 1, 8, 192 and 256 rows and
an 8192-token prefill step, 8 slots of rank 16, rows mixing every slot with -1, sorted by
slot, or all in one slot (the "1 adapter" case). Then the three kernels captured in one CUDA
graph and replayed with fresh inputs and slots written in place."""
import pytest
import torch

from batchrun.kernels.act_and_mul import act_and_mul
from batchrun.kernels.fused_add_rms_norm import fused_add_rms_norm
from batchrun.kernels.reference import ref_act_and_mul, ref_fused_add_rms_norm, ref_rotary
from batchrun.kernels.rotary import apply_rotary
from kernel_testutils import randn
from test_graph_capture import capture
from test_lora_fused_consumers import (_check_act, _check_norm, _check_rotary, _fused_output,
                                       _slots, _tol)
from test_rotary import cos_sin_cache

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16, L, R = torch.bfloat16, 8, 16
SIZES = [1, 8, 192, 256, 8192]
PATTERNS = ["mixed", "sorted", "one"]


@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_norm_7b(T, pattern):
    _check_norm(T, 4096, L, R, BF16, True, pattern)


@pytest.mark.parametrize("T", [8, 256])
def test_plain_norm_7b(T):
    _check_norm(T, 4096, L, R, BF16, False, "mixed")


@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_act_and_mul_7b(T, pattern):
    _check_act(T, 11008, L, R, BF16, pattern)


@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("Hkv", [32, 8])  # Llama-2-7b MHA; GQA (Llama-3 shape)
def test_rotary_7b(T, pattern, Hkv):
    _check_rotary(T, 32, Hkv, 128, L, R, BF16, seed=T + Hkv, pattern=pattern)


@pytest.mark.parametrize("T", [8, 256])
def test_consumers_replay_from_a_graph(T):
    """Capture rotary + norm + SiLU with their deltas once, then rewrite every input and the
    slots in place and replay: each replay matches the reference for its own inputs."""
    H, I, Hq, Hkv, D = 4096, 11008, 32, 8, 128
    x, dn, _ = _fused_output(T, [H], L, R, BF16, seed=1)
    gu, ds, _ = _fused_output(T, [I, I], L, R, BF16, seed=2)
    qkv, dr, _ = _fused_output(T, [Hq * D, Hkv * D, Hkv * D], L, R, BF16, seed=3)
    slots = torch.empty(T + 5, dtype=torch.int32, device="cuda")
    for d in (dn, ds, dr):
        d.token_slots = slots  # one slot buffer, as the engine binds it
    gen = torch.Generator().manual_seed(T)
    w = randn(H, dtype=BF16, gen=gen)
    res = torch.zeros(T, H, dtype=BF16, device="cuda")  # the capture run reads it
    out_n = torch.empty(T, H, dtype=BF16, device="cuda")
    out_s = torch.empty(T, I, dtype=BF16, device="cuda")
    positions = torch.zeros(T, dtype=torch.long, device="cuda")
    cs = cos_sin_cache(D, 4096)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))

    def step():
        apply_rotary(q, k, cs, positions, v=v, lora=dr)
        fused_add_rms_norm(x, res, w, 1e-5, out=out_n, lora=dn)
        act_and_mul(gu, out=out_s, lora=ds)

    slots.fill_(-1)
    graph = capture(step)
    for trial, pattern in enumerate(["mixed", "one", "sorted", "mixed"]):
        slots.copy_(torch.cat([_slots(T, L, gen, pattern), torch.zeros(5, dtype=torch.int32)]))
        for t in (x, gu, qkv, res, dn.shrunk, ds.shrunk, dr.shrunk):
            t.copy_(randn(*t.shape, dtype=BF16, gen=gen))
        positions.copy_(torch.randint(0, 4096, (T,), generator=gen))
        res0, qkv_fixed = res.clone(), dr.apply_reference(qkv)
        want_n, want_res = ref_fused_add_rms_norm(dn.apply_reference(x), res0, w, 1e-5)
        want_s = ref_act_and_mul(ds.apply_reference(gu))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in ((res, want_res), (out_n, want_n), (out_s, want_s)):
            scale = want.float().abs().mean(-1, keepdim=True)
            assert (got.float() - want.float()).abs().le(_tol(want, BF16, scale)).all(), trial
        fq, fk, fv = (t.view(T, -1, D)
                      for t in qkv_fixed.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
        for got, want in ((q, ref_rotary(fq, cs, positions)), (k, ref_rotary(fk, cs, positions)),
                          (v, fv)):
            pair = want.float().abs() + want.float().abs().roll(D // 2, dims=-1)
            assert (got.float() - want.float()).abs().le(_tol(want, BF16, pair)).all(), trial


def test_consumers_are_deterministic():
    T = 256
    gu, ds, _ = _fused_output(T, [11008, 11008], L, R, BF16, seed=9)
    x, dn, _ = _fused_output(T, [4096], L, R, BF16, seed=10)
    w = randn(4096, dtype=BF16, gen=torch.Generator().manual_seed(0))
    res = randn(T, 4096, dtype=BF16, gen=torch.Generator().manual_seed(1))
    first = act_and_mul(gu, lora=ds), fused_add_rms_norm(x, res.clone(), w, 1e-5, lora=dn)[0]
    for _ in range(3):
        again = act_and_mul(gu, lora=ds), fused_add_rms_norm(x, res.clone(), w, 1e-5, lora=dn)[0]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
