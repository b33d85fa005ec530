"""Time the LoRA shrink/expand and paged decode attention kernels on CUDA for decode shapes.

    python benchmarks/kernels_bench.py [--json benchmarks/results/kernels-<date>.json]

Times come from triton.testing.do_bench_cudagraph (the kernels run replayed from CUDA graphs in
the engine, so launch overhead is excluded the same way). Llama-2-7b-shaped, random bf16 data.
Effective bandwidth counts the bytes a kernel must move at least (weights of the active slots,
activations, outputs), so it shows how close to memory-bound a kernel is.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess

import torch
import triton

from batchrun.kernels.lora_expand import lora_expand
from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.kernels.lora_shrink import lora_shrink, shrink_num_splits
from batchrun.kernels.paged_attention import paged_decode_attention

DT = torch.bfloat16
L = 4  # GPU slots
# (name, K, output slice sizes) of Llama-2-7b's LoRA-wrapped projections
LAYERS = [("qkv", 4096, (4096, 4096, 4096)), ("qkv_gqa", 4096, (4096, 1024, 1024)),
          ("o", 4096, (4096,)), ("gate_up", 4096, (11008, 11008)), ("down", 11008, (4096,))]


def bench(fn) -> float:
    # do_bench_cudagraph runs fn first on a fresh side stream that does not wait for the default
    # stream: without this sync it can read inputs (e.g. a block table) before they are written,
    # which is how this script hit "illegal memory access" in its attention rows on the H200.
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3  # us


def lora_rows(tokens, ranks, active):
    rows = []
    for T, R, (name, K, sizes) in itertools.product(tokens, ranks, LAYERS):
        S, offs = len(sizes), (0, *itertools.accumulate(sizes))
        N = offs[-1]
        x = torch.randn(T, K, dtype=DT, device="cuda")
        a = torch.randn(S, L, R, K, dtype=DT, device="cuda") * K ** -0.5
        b = torch.randn(L, N, R, dtype=DT, device="cuda") * R ** -0.5
        splits = shrink_num_splits(T, K, S)  # as batchrun.engine.lora.punica.add_lora chooses
        buf = torch.empty(splits, S, T, R, dtype=torch.float32, device="cuda")
        y = torch.randn(T, N, dtype=DT, device="cuda")
        meta = LoRAKernelMeta.allocate(T, L, "cuda")
        meta.prepare((torch.arange(T, device="cuda") % active).to(torch.int32))  # `active` slots in use
        t_s = bench(lambda: lora_shrink(x, a, buf, meta))
        t_e = bench(lambda: lora_expand(buf, b, y, offs, meta))
        n_act = min(active, T)
        shrink_bytes = x.numel() * 2 + n_act * S * R * K * 2 + buf.numel() * 4
        expand_bytes = n_act * N * R * 2 + 2 * y.numel() * 2 + buf.numel() * 4
        rows.append(dict(op="lora", layer=name, T=T, R=R, active_slots=n_act, splits=splits,
                         shrink_us=t_s, shrink_GBps=shrink_bytes / t_s / 1e3,
                         expand_us=t_e, expand_GBps=expand_bytes / t_e / 1e3))
    return rows


def attention_rows(batches, ctxs, heads):
    rows = []
    D, bs = 128, 16
    for B, ctx, (Hq, Hkv) in itertools.product(batches, ctxs, heads):
        max_blocks = triton.cdiv(max(ctxs), bs)
        nblk = B * triton.cdiv(ctx, bs)
        kc = torch.randn(nblk, bs, Hkv, D, dtype=DT, device="cuda")
        vc = torch.randn_like(kc)
        q = torch.randn(B, Hq, D, dtype=DT, device="cuda")
        tables = torch.zeros(B, max_blocks, dtype=torch.int32, device="cuda")
        tables[:, :triton.cdiv(ctx, bs)] = torch.randperm(nblk, device="cuda").view(B, -1).int()
        lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        t = bench(lambda: paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, out))
        kv_bytes = 2 * B * ctx * Hkv * D * 2
        rows.append(dict(op="decode_attention", B=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, us=t,
                         GBps=kv_bytes / t / 1e3))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the rows (and command, commit, device) here")
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--active-slots", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)

    lora = lora_rows(args.tokens, args.ranks, args.active_slots)
    print(f"{'layer':9} {'T':>4} {'R':>3} {'shrink us':>10} {'GB/s':>6} {'expand us':>10} {'GB/s':>6}")
    for r in lora:
        print(f"{r['layer']:9} {r['T']:4} {r['R']:3} {r['shrink_us']:10.2f} {r['shrink_GBps']:6.0f} "
              f"{r['expand_us']:10.2f} {r['expand_GBps']:6.0f}")
    attn = attention_rows([1, 8, 64, 256], [160, 1024, 4096], [(32, 32), (32, 8)])
    print(f"\n{'B':>4} {'ctx':>5} {'Hq/Hkv':>7} {'attn us':>9} {'GB/s':>6}")
    for r in attn:
        print(f"{r['B']:4} {r['ctx']:5} {r['Hq']:3}/{r['Hkv']:<3} {r['us']:9.2f} {r['GBps']:6.0f}")

    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump(dict(command="python benchmarks/kernels_bench.py", commit=commit,
                           device=torch.cuda.get_device_name(), dtype="bfloat16 (random weights)",
                           rows=lora + attn), f, indent=1)


if __name__ == "__main__":
    main()
