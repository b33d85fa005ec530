"""Diagnose the decode-attention crash seen in kernels_bench.py on the H200 (2026-12-02):
run each shape alone, eagerly and under do_bench_cudagraph, with a sync after each."""
import sys
import torch
import triton
from batchrun.kernels.paged_attention import paged_decode_attention
from batchrun.kernels.reference import ref_paged_decode_attention

B, ctx, Hq, Hkv, width, mode = (int(a) if a.isdigit() else a for a in sys.argv[1:7])
D, bs = 128, 16
nblk = B * triton.cdiv(ctx, bs)
kc = torch.randn(nblk, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
vc = torch.randn_like(kc)
q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda")
tables = torch.zeros(B, triton.cdiv(width, bs), dtype=torch.int32, device="cuda")
tables[:, :triton.cdiv(ctx, bs)] = torch.randperm(nblk, device="cuda").view(B, -1).int()
lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
out = torch.empty_like(q)
fn = lambda: paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, out)  # noqa: E731
fn(); torch.cuda.synchronize()
ref = ref_paged_decode_attention(q.float(), kc.float(), vc.float(), tables, lens, D ** -0.5)
err = ((out.float() - ref).norm() / ref.norm()).item()
t = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3 if mode == "graph" else float("nan")
torch.cuda.synchronize()
print(f"OK B={B} ctx={ctx} Hq={Hq} Hkv={Hkv} width={width} rel_err={err:.1e} us={t:.1f}")
