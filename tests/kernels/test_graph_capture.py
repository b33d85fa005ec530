"""The kernels are replayed from CUDA graphs with metadata rewritten in place between replays:
capture once, change slots / context lengths / inputs, replay, compare to the reference."""
import itertools

import pytest
import torch

from batchrun.kernels.lora_expand import lora_expand
from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.lora_shrink import lora_shrink, shrink_num_splits
from batchrun.kernels.paged_attention import paged_decode_attention
from batchrun.kernels.reference import ref_lora_expand, ref_lora_shrink, ref_paged_decode_attention
from kernel_testutils import mixed_slots, randn, rounding_tol

pytestmark = pytest.mark.gpu


def capture(fn):
    # Warm up (compiles the kernels) on a side stream, as torch.cuda.graphs recommends.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.parametrize("T", [8, 64])
def test_lora_graph_replay_follows_prepare(T):
    gen = torch.Generator().manual_seed(T)
    dt, K, R, L, sizes = torch.bfloat16, 4096, 16, 4, (4096, 1024, 1024)
    offs = (0, *itertools.accumulate(sizes))
    N, S = offs[-1], len(sizes)
    meta = LoRAKernelMeta.allocate(max_tokens=256, max_loras=L, device="cuda")
    x = torch.empty(T, K, dtype=dt, device="cuda")
    a = randn(S, L, R, K, dtype=dt, gen=gen, scale=K ** -0.5)
    b = randn(L, N, R, dtype=dt, gen=gen, scale=R ** -0.5)
    # Split-K partials, never zeroed: every replay must overwrite every partial it sums.
    buf = torch.full((shrink_num_splits(T, K, S), S, 256, R), float("nan"), device="cuda")
    y = torch.empty(T, N, dtype=dt, device="cuda")

    def step():
        lora_shrink(x, a, buf, meta)
        lora_expand(buf, b, y, offs, meta)

    meta.prepare(mixed_slots(T, L, gen).cuda())
    x.copy_(randn(T, K, dtype=dt, gen=gen))
    g = capture(step)
    for trial in range(4):
        slots = mixed_slots(T, L if trial < 3 else 0, gen)   # last trial: no LoRA token at all
        if trial == 1:
            slots[:] = trial                                  # one slot for the whole batch
        meta.prepare(slots.cuda())
        x.copy_(randn(T, K, dtype=dt, gen=gen))
        y0 = randn(T, N, dtype=dt, gen=gen)
        y.copy_(y0)
        g.replay()
        torch.cuda.synchronize()
        ref_buf = ref_lora_shrink(x, a, slots)
        ref = ref_lora_expand(y0, ref_buf, b, offs, slots)
        ref_abs = ref_lora_expand(y0.abs(), ref_lora_shrink(x.abs(), a.abs(), slots), b.abs(), offs, slots)
        tol = rounding_tol(ref_abs.float(), dt, K) + 2.0 ** -15 * ref_abs.float()
        assert ((y.float() - ref.float()).abs() <= tol).all(), trial


@pytest.mark.parametrize("num_splits", [None, 4])
def test_decode_attention_graph_replay_follows_context_lens(num_splits):
    gen = torch.Generator().manual_seed(0)
    dt, B, Hq, Hkv, D, bs, max_blocks, num_blocks = torch.bfloat16, 8, 32, 8, 128, 16, 64, 600
    q = torch.empty(B, Hq, D, dtype=dt, device="cuda")
    kc = randn(num_blocks, bs, Hkv, D, dtype=dt, gen=gen)
    vc = randn(num_blocks, bs, Hkv, D, dtype=dt, gen=gen)
    tables = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
    lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, Hq, D, dtype=dt, device="cuda")
    g = capture(lambda: paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, out,
                                               num_splits=num_splits))
    for trial in range(3):
        new_lens = torch.randint(0, max_blocks * bs + 1, (B,), generator=gen, dtype=torch.int32)
        new_lens[0] = 0
        tables.copy_(torch.randperm(num_blocks, generator=gen)[:B * max_blocks].view(B, max_blocks))
        lens.copy_(new_lens)
        q.copy_(randn(B, Hq, D, dtype=dt, gen=gen))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = ref_paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5)
        assert not out.isnan().any()
        assert (out.float() - ref.float()).abs().max().item() <= 4 * torch.finfo(dt).eps * vc.abs().max().item()
