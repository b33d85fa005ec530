"""Attention kernel microbenchmark on CUDA: paged decode (alone) and varlen prefill vs the old
per-sequence SDPA loop. Llama-2-7B shapes (32 heads, head_dim 128), random bf16, page size 16.

    PYTHONPATH=. python benchmarks/kernel_attention.py [--sweep] [--json out.json]

- decode: 256 sequences x ~384 context tokens (the offline workload's decode); bytes = the K/V
  it must read (+ q, out), GB/s and the fraction of 4.2 TB/s (the H200's measured copy rate is
  ~4.3 TB/s). Timed with do_bench_cudagraph: the engine replays decode from CUDA graphs.
- decode splits: small batches x long contexts, each split count vs the heuristic's choice.
- prefill: 8 x 32 and 256 x 256 new tokens, and chunked (context from the cache + new tokens);
  the kernel vs PagedAttention's per-sequence loop, both eager (prefill runs eagerly), with
  the causal attention TFLOP/s.
--sweep also times launch configs (tile sizes, warps, stages) to pick the defaults.
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess

import torch
import triton

from batchrun.kernels.paged_attention import _num_sms, decode_num_splits, paged_decode_attention
from batchrun.kernels.prefill_attention import prefill_attention
from batchrun.engine.layers.attention import AttnMetadata, PagedAttention, query_start_tensor

DT, D, BS = torch.bfloat16, 128, 16
PEAK_TBPS = 4.2


def bench_graph(fn) -> float:
    torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for setup work
    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3  # us


def bench_eager(fn) -> float:
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3  # us


def tried(fn, *args, tuning, **kw):
    # a sweep config can exceed shared memory / registers: record the error, keep going
    try:
        return fn(*args, tuning=tuning, **kw)
    except Exception as e:  # noqa: BLE001 - benchmark sweep, reported in the row
        return dict(op=fn.__name__, tuning=tuning, error=f"{type(e).__name__}: {str(e)[:200]}")


def paged_cache(ctx_lens, Hkv, max_blocks):
    """Random K/V pages for the given contexts, shuffled over the cache; int32 tables."""
    need = [triton.cdiv(n, BS) for n in ctx_lens]
    nblk = sum(need) + 1
    kc = torch.randn(nblk, BS, Hkv, D, dtype=DT, device="cuda")
    vc = torch.randn_like(kc)
    perm = (torch.randperm(nblk - 1, device="cuda") + 1).int()
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int32, device="cuda")
    o = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[o:o + n]
        o += n
    return kc, vc, tables


def decode_row(B, ctx_lens, Hq, Hkv, max_blocks, num_splits=None, tuning=None):
    kc, vc, tables = paged_cache(ctx_lens, Hkv, max_blocks)
    q = torch.randn(B, Hq, D, dtype=DT, device="cuda")
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    t = bench_graph(lambda: paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, out,
                                                   num_splits=num_splits, tuning=tuning))
    nbytes = 2 * sum(ctx_lens) * Hkv * D * 2 + 2 * q.numel() * 2 + tables.numel() * 4
    gbps = nbytes / t / 1e3
    return dict(op="decode", B=B, ctx_avg=sum(ctx_lens) / B, Hq=Hq, Hkv=Hkv, us=round(t, 2),
                GBps=round(gbps), frac_of_4_2TBps=round(gbps / (PEAK_TBPS * 1e3), 3),
                num_splits=num_splits, tuning=tuning)


def decode_rows(sweep):
    rows = []
    gen = torch.Generator().manual_seed(0)
    max_blocks = 2048 // BS  # table sized for max_model_len 2048
    even = [384] * 256
    spread = torch.randint(320, 449, (256,), generator=gen).tolist()  # ~384 on average
    for Hq, Hkv in [(32, 32), (32, 8)]:
        for lens in (even, spread):
            rows.append(decode_row(256, lens, Hq, Hkv, max_blocks))
    if sweep:
        for bn, w, st in itertools.product([32, 64, 128], [4, 8], [2, 3]):
            rows.append(tried(decode_row, 256, even, 32, 32, max_blocks,
                              tuning=dict(block_n=bn, num_warps=w, num_stages=st)))
    # split-KV: small batches, long contexts; the heuristic's pick is num_splits=None
    sms = _num_sms(torch.cuda.current_device())
    for B, ctx, (Hq, Hkv) in itertools.product([1, 8, 32], [1024, 4096], [(32, 32), (32, 8)]):
        mb = 4096 // BS
        pick = decode_num_splits(B * Hkv, mb * BS, sms)
        for s in sorted({1, 2, 4, 8, 16, pick}) if sweep else sorted({1, pick}):
            r = decode_row(B, [ctx] * B, Hq, Hkv, mb, num_splits=s)
            r["heuristic_pick"] = pick
            rows.append(r)
    return rows


def prefill_case(seqs, Hq, Hkv, tuning=None, with_loop=True):
    """seqs: (cached, new) per sequence. Times the kernel and the old per-sequence loop."""
    ctx = [c + n for c, n in seqs]
    q_lens = [n for _, n in seqs]
    max_blocks = triton.cdiv(max(ctx), BS)
    kc, vc, tables = paged_cache(ctx, Hkv, max_blocks)
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, dtype=DT, device="cuda")
    qs = query_start_tensor(q_lens, "cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    t = bench_eager(lambda: prefill_attention(q, kc, vc, tables, qs, ctx_t, max(q_lens),
                                              D ** -0.5, out, tuning=tuning))
    # causal: query at position p sees p + 1 keys; 2 dots of 2*D flops per (query, key, head)
    pairs = sum(sum(range(c + 1, c + n + 1)) for c, n in seqs)
    tflops = 4 * D * Hq * pairs / t / 1e6
    row = dict(op="prefill", seqs=len(seqs), new_tokens=T, cached_tokens=sum(c for c, _ in seqs),
               Hq=Hq, Hkv=Hkv, kernel_us=round(t, 1), kernel_TFLOPs=round(tflops, 1),
               tuning=tuning)
    if with_loop:
        layer = PagedAttention(Hq, Hkv, D)
        layer.k_cache, layer.v_cache = kc, vc
        meta = AttnMetadata(True, None, tables, ctx_t, query_lens=q_lens, context_lens_host=ctx)
        ref = layer._prefill_per_sequence(q, meta)
        prefill_attention(q, kc, vc, tables, qs, ctx_t, max(q_lens), D ** -0.5, out)
        row["max_abs_diff_vs_loop"] = (out.float() - ref.float()).abs().max().item()
        tl_ = bench_eager(lambda: layer._prefill_per_sequence(q, meta))
        row.update(loop_us=round(tl_, 1), speedup=round(tl_ / t, 2))
    return row


def prefill_rows(sweep):
    rows = []
    cases = {"8x32": [(0, 32)] * 8, "256x256": [(0, 256)] * 256,
             "chunked 4x(1024 cached + 512 new)": [(1024, 512)] * 4}
    for name, seqs in cases.items():
        for Hq, Hkv in [(32, 32), (32, 8)]:
            r = prefill_case(seqs, Hq, Hkv)
            r["case"] = name
            rows.append(r)
    if sweep:
        for bm, bn, w, st in itertools.product([64, 128], [32, 64], [4, 8], [2, 3]):
            r = tried(prefill_case, cases["256x256"], 32, 32, with_loop=False,
                      tuning=dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st))
            r["case"] = "256x256"
            rows.append(r)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", action="store_true", help="also time launch configs")
    p.add_argument("--json", help="also write the rows (and command, commit, device) here")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for r in decode_rows(args.sweep):
        rows.append(r)
        print(json.dumps(r), flush=True)
    for r in prefill_rows(args.sweep):
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump(dict(command="python benchmarks/kernel_attention.py" + (" --sweep" if args.sweep else ""),
                           commit=commit, device=torch.cuda.get_device_name(),
                           dtype="bfloat16 (random)", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
