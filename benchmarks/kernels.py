"""Kernel microbenchmarks on CUDA: batchrun's Triton kernels against cuBLAS or their torch
reference (kernels/reference.py), Llama-2-7b shapes, RANDOM bf16 data. Each case prints µs and
the fraction of the card's HBM bandwidth (batchrun/bench/roofline.py) its bytes reach; gemm,
lora and attention cases also print their error against the reference in fp32 (the consumers'
outputs are checked by tests/kernels/test_lora_fused_consumers.py).

    PYTHONPATH=. python3 benchmarks/kernels.py gemm [--m 1 8 16] [--sweep] [--json F]
    PYTHONPATH=. python3 benchmarks/kernels.py fp8 [--m 1 8 16] [--sweep] [--json F]
    PYTHONPATH=. python3 benchmarks/kernels.py lora [--tokens 8 64 256] [--ranks 16 64] [--json F]
    PYTHONPATH=. python3 benchmarks/kernels.py consumers [--tokens 8 256 8192] [--json F]
    PYTHONPATH=. python3 benchmarks/kernels.py attention [--sweep] [--json F]

- gemm: the decode GEMMs of few rows, cuBLAS against the weight-streaming skinny GEMM
  (kernels/skinny_gemm.py) and, for gate_up, cuBLAS + SiLU-and-mul against the GEMM with SiLU in
  its epilogue (kernels/skinny_gate_up_silu.py). Each weight is cold in L2 as in a real step: a
  case runs over enough copies of the weight (>= 512 MB) inside one CUDA graph and its time is
  the graph's over the copies (one weight timed over and over sits in the 50 MB L2 and flatters
  every kernel). --sweep also times other launch configs.
- fp8: the decode GEMMs of an FP8 Llama-3-8B (e4m3 weights per channel, activations per
  token): torch._scaled_mm against kernels/fp8_gemm.py, weights cold; --sweep times tilings.
- lora: the Punica-style shrink / expand kernels (prefill steps above the fused-LoRA limit).
- consumers: the kernels that add a LoRA delta after a projection (add+RMSNorm after o/down,
  SiLU-and-mul after gate_up, rotary after qkv) against their plain launches, for one adapter,
  8 adapters with rows sorted by slot (as the engine orders them) and 8 adapters shuffled.
- attention: paged decode attention (256 rows x ~384 context; small batches x long contexts
  over split counts) inside CUDA graphs, and varlen prefill attention eagerly (as prefill runs),
  with its causal TFLOP/s. --sweep also times launch configs (tile sizes, warps, stages).

Decode-path cases are timed with triton.testing.do_bench_cudagraph (the engine replays decode
from CUDA graphs, so launch gaps are excluded the same way).
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
import triton

from batchrun.bench.record import environment, write_json
from batchrun.bench.roofline import hbm_peak

DT = torch.bfloat16
COLD_BYTES = 512 << 20


def bench_graph(fn, rep: int = 50) -> float:
    """µs of fn replayed from a CUDA graph. The sync first: do_bench_cudagraph runs fn on a side
    stream that does not wait for the default stream's setup writes."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3


def bench_eager(fn) -> float:
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def hbm() -> float:
    name = torch.cuda.get_device_name()
    peak = hbm_peak(name)
    if peak is None:
        sys.exit(f"no HBM peak known for {name!r}: add it to batchrun/bench/roofline.py")
    return peak


# ---- gemm ------------------------------------------------------------------------------------
GEMM_SHAPES = {"7b qkv": (12288, 4096), "7b o": (4096, 4096), "7b gate_up": (22016, 4096),
               "7b down": (4096, 11008), "7b lm_head": (32000, 4096), "8b qkv": (6144, 4096),
               "8b gate_up": (28672, 4096), "8b down": (4096, 14336)}
LAYER_7B = ("7b qkv", "7b o", "7b gate_up", "7b down")  # a layer's GEMMs (+ lm_head once a step)
# (BLOCK_N, BLOCK_K, num_stages, num_warps) tried besides each kernel's default with --sweep
SWEEP_CONFIGS = [(32, 256, 4, 4), (16, 512, 4, 4), (64, 128, 5, 4), (32, 128, 4, 4), (16, 256, 4, 4)]


def cold_copies(n: int, k: int) -> list[torch.Tensor]:
    copies = max(2, -(-COLD_BYTES // (n * k * DT.itemsize)))
    return [torch.randn(n, k, device="cuda", dtype=DT) * 0.02 for _ in range(copies)]


def time_cases(op: str, name: str, m: int, n: int, k: int, cases: dict, ws: list, ref, nbytes: int,
               peak: float, rows: list) -> dict[str, float]:
    """Each case (label -> f(weight)) checked against ref on the first weight copy and timed over
    all of them in one CUDA graph; a row per case into `rows`, a line each printed -> {label: µs}
    of the cases that ran (a sweep config may exceed shared memory: recorded as its error)."""
    res = {}
    for label, f in cases.items():
        try:
            err = rel_err(f(ws[0]), ref)
            us = bench_graph(lambda f=f: [f(w) for w in ws], rep=40) / len(ws)
        except Exception as e:  # noqa: BLE001 - recorded, and the other cases still run
            rows.append({"op": op, "gemm": name, "M": m, "case": label, "error": str(e)[:200]})
            print(f"M={m:<3d}{name:11s} {label:28s} failed: {str(e)[:200]}")
            continue
        res[label] = us
        rows.append({"op": op, "gemm": name, "M": m, "N": n, "K": k, "case": label,
                     "us": round(us, 2), "fraction_of_hbm": round(nbytes / (us * 1e-6) / peak, 3),
                     "rel_err_vs_fp32": err})
        print(f"M={m:<3d}{name:11s} {label:28s} {us:8.2f} µs ({nbytes / (us * 1e-6) / peak:6.1%})"
              f"  rel err {err:.1e}")
    return res


def run_gemm(a) -> list[dict]:
    from batchrun.kernels.act_and_mul import act_and_mul
    from batchrun.kernels.reference import ref_act_and_mul
    from batchrun.kernels.skinny_gate_up_silu import skinny_gate_up_silu
    from batchrun.kernels.skinny_gemm import skinny_gemm
    peak, rows = hbm(), []
    print(f"{torch.cuda.get_device_name()}; RANDOM bf16 weights, cold in L2; µs per GEMM "
          f"(fraction of {peak / 1e12:.2f} TB/s)")
    step = {m: {"cublas": 0.0, "best": 0.0} for m in a.m}
    for name, (n, k) in GEMM_SHAPES.items():
        ws = cold_copies(n, k)
        for m in a.m:
            x = torch.randn(m, k, device="cuda", dtype=DT)
            nbytes = (n * k + m * k + m * n) * DT.itemsize
            gate_up = "gate_up" in name
            ref = F.linear(x.float(), ws[0].float())
            ref = ref_act_and_mul(ref) if gate_up else ref
            cases = {"cublas": (lambda w: act_and_mul(F.linear(x, w))) if gate_up
                     else (lambda w: F.linear(x, w))}
            kernel = skinny_gate_up_silu if gate_up else skinny_gemm
            cases["triton"] = lambda w: kernel(x, w)
            if a.sweep:
                for c in SWEEP_CONFIGS:
                    cases[f"triton {c}"] = lambda w, c=c: kernel(x, w, config=c)
            res = time_cases("gemm", name, m, n, k, cases, ws, ref, nbytes, peak, rows)
            times = 32 if name in LAYER_7B else 1 if name == "7b lm_head" else 0
            step[m]["cublas"] += times * res.get("cublas", float("nan"))
            step[m]["best"] += times * min(res.values(), default=float("nan"))
        del ws
    for m, s in step.items():
        print(f"M={m}: a 7b decode step's GEMMs (32 layers + lm_head): cuBLAS {s['cublas']:.0f} µs, "
              f"best kernel per shape {s['best']:.0f} µs ({s['best'] - s['cublas']:+.0f} µs)")
        rows.append({"op": "gemm_step_7b", "M": m, **{f"{k}_us": v for k, v in s.items()}})
    return rows


# ---- FP8 decode GEMMs ------------------------------------------------------------------------
FP8_SHAPES = {k: v for k, v in GEMM_SHAPES.items() if k.startswith("8b")}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) tried besides fp8_gemm's SKINNY with --sweep
FP8_SWEEP = [(16, 32, 128, 4, 4), (16, 16, 256, 4, 4), (16, 32, 256, 4, 4), (16, 64, 256, 3, 4),
             (16, 128, 128, 4, 4), (16, 32, 512, 3, 4), (16, 64, 128, 6, 4)]


def run_fp8(a) -> list[dict]:
    """The decode GEMMs of an FP8 Llama-3-8B (per-channel e4m3 weights, per-token activations):
    torch._scaled_mm against batchrun's fp8_gemm (the engine's decode kernel), weights cold."""
    from batchrun.kernels.fp8_gemm import SKINNY, fp8_gemm
    from batchrun.kernels.fp8_quant import quant_fp8
    peak, rows = hbm(), []
    print(f"{torch.cuda.get_device_name()}; RANDOM e4m3 weights, cold in L2; µs per GEMM "
          f"(fraction of {peak / 1e12:.2f} TB/s)")
    for name, (n, k) in FP8_SHAPES.items():
        copies = max(2, -(-COLD_BYTES // (n * k)))
        # e4m3 values as per-channel quantization leaves them: 4 sigma at e4m3's 448
        ws = [(torch.randn(n, k, device="cuda") * 112).clamp(-448, 448).to(torch.float8_e4m3fn)
              for _ in range(copies)]
        scale = torch.rand(n, device="cuda") * 1e-3 + 1e-4
        for m in a.m:
            x = torch.randn(m, k, device="cuda", dtype=DT)
            xq, xs = quant_fp8(x)
            ref = (xq.float() * xs) @ (ws[0].float() * scale[:, None]).t()
            nbytes = n * k + m * k + m * n * DT.itemsize
            cases = {"scaled_mm": lambda w: torch._scaled_mm(
                         xq, w.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=DT),
                     f"triton {SKINNY}": lambda w: fp8_gemm(xq, xs, w, scale, None, DT)}
            if a.sweep:
                for c in FP8_SWEEP:
                    cases[f"triton {c}"] = lambda w, c=c: fp8_gemm(xq, xs, w, scale, None, DT, config=c)
            time_cases("fp8_gemm", name, m, n, k, cases, ws, ref, nbytes, peak, rows)
        del ws
    return rows


# ---- lora shrink / expand --------------------------------------------------------------------
LORA_SLOTS = 4
LORA_LAYERS = [("qkv", 4096, (4096, 4096, 4096)), ("qkv_gqa", 4096, (4096, 1024, 1024)),
               ("o", 4096, (4096,)), ("gate_up", 4096, (11008, 11008)), ("down", 11008, (4096,))]


def run_lora(a) -> list[dict]:
    from batchrun.kernels.lora_expand import lora_expand
    from batchrun.kernels.lora_meta import LoRAKernelMeta
    from batchrun.kernels.lora_shrink import lora_shrink, shrink_num_splits
    from batchrun.kernels.reference import ref_lora_expand, ref_lora_shrink
    peak, rows = hbm(), []
    print(f"{torch.cuda.get_device_name()}; {LORA_SLOTS} slots, {a.active_slots} in use; µs "
          f"(fraction of {peak / 1e12:.2f} TB/s)")
    print(f"{'layer':9} {'T':>5} {'R':>3} {'shrink µs':>10} {'of HBM':>7} {'expand µs':>10} {'of HBM':>7}  rel err")
    for T, R, (name, K, sizes) in itertools.product(a.tokens, a.ranks, LORA_LAYERS):
        S, offs = len(sizes), (0, *itertools.accumulate(sizes))
        N = offs[-1]
        x = torch.randn(T, K, dtype=DT, device="cuda")
        lora_a = torch.randn(S, LORA_SLOTS, R, K, dtype=DT, device="cuda") * K ** -0.5
        lora_b = torch.randn(LORA_SLOTS, N, R, dtype=DT, device="cuda") * R ** -0.5
        slots = (torch.arange(T, device="cuda") % a.active_slots).to(torch.int32)
        splits = shrink_num_splits(T, K, S)  # as the engine's punica wrapper chooses
        buf = torch.empty(splits, S, T, R, dtype=torch.float32, device="cuda")
        y0 = torch.randn(T, N, dtype=DT, device="cuda")
        y = y0.clone()
        meta = LoRAKernelMeta.allocate(T, LORA_SLOTS, "cuda")
        meta.prepare(slots)
        buf.zero_()
        lora_shrink(x, lora_a, buf, meta)
        shrunk = buf.sum(0)
        err_s = rel_err(shrunk, ref_lora_shrink(x, lora_a, slots))
        lora_expand(buf, lora_b, y, offs, meta)
        err_e = rel_err(y, ref_lora_expand(y0.clone(), shrunk, lora_b, offs, slots))
        t_s = bench_graph(lambda: lora_shrink(x, lora_a, buf, meta), rep=100)
        t_e = bench_graph(lambda: lora_expand(buf, lora_b, y, offs, meta), rep=100)
        used = min(a.active_slots, T)
        shrink_bytes = x.numel() * 2 + used * S * R * K * 2 + buf.numel() * 4
        expand_bytes = used * N * R * 2 + 2 * y.numel() * 2 + buf.numel() * 4
        rows.append(dict(op="lora", layer=name, T=T, R=R, active_slots=used, splits=splits,
                         shrink_us=t_s, shrink_fraction_of_hbm=shrink_bytes / (t_s * 1e-6) / peak,
                         expand_us=t_e, expand_fraction_of_hbm=expand_bytes / (t_e * 1e-6) / peak,
                         shrink_rel_err=err_s, expand_rel_err=err_e))
        r = rows[-1]
        print(f"{name:9} {T:5} {R:3} {t_s:10.2f} {r['shrink_fraction_of_hbm']:7.1%} {t_e:10.2f} "
              f"{r['expand_fraction_of_hbm']:7.1%}  {max(err_s, err_e):.1e}")
    return rows


# ---- LoRA consumers --------------------------------------------------------------------------
C_SLOTS, C_RANK = 8, 16
H, I, HEADS, D = 4096, 11008, 32, 128


def slots_for(T: int, pattern: str) -> torch.Tensor:
    if pattern == "1 adapter":
        s = torch.zeros(T, dtype=torch.int32)
    else:
        s = (torch.arange(T) % C_SLOTS).to(torch.int32)
        s = s.sort().values if pattern == "8 sorted" else s[torch.randperm(T)]
    return s.to("cuda")


def stacked_output(T: int, sizes: list[int], slots: torch.Tensor):
    """(y [T, N], delta) laid out as the stacked [W; A] GEMM leaves them (one strided buffer)."""
    from batchrun.kernels.lora_meta import LoRADelta
    N, S = sum(sizes), len(sizes)
    full = torch.randn(T, N + S * C_SLOTS * C_RANK, dtype=DT, device="cuda")
    b = torch.randn(C_SLOTS, N, C_RANK, dtype=DT, device="cuda") * C_RANK ** -0.5
    offs = (0, *itertools.accumulate(sizes))
    return full[:, :N], LoRADelta(full[:, N:], b, slots, offs)


def run_consumers(a) -> list[dict]:
    from batchrun.kernels.fused_add_rms_norm import fused_add_rms_norm
    from batchrun.kernels.rotary import apply_rotary
    from batchrun.kernels.act_and_mul import act_and_mul
    peak, rows = hbm(), []
    print(f"{torch.cuda.get_device_name()}; {C_SLOTS} slots of rank {C_RANK}; µs")
    print(f"{'op':13} {'T':>5} {'slots':10} {'plain µs':>9} {'LoRA µs':>9} {'x plain':>8} {'of HBM':>7}")
    for T, pattern in itertools.product(a.tokens, ("1 adapter", "8 sorted", "8 mixed")):
        slots = slots_for(T, pattern)
        used = len(set(slots.tolist()))
        cases = []
        x, d = stacked_output(T, [H], slots)
        res, w = torch.randn(T, H, dtype=DT, device="cuda"), torch.randn(H, dtype=DT, device="cuda")
        o = torch.empty(T, H, dtype=DT, device="cuda")
        cases.append(("add+RMSNorm", lambda: fused_add_rms_norm(x, res, w, 1e-6, out=o),
                      lambda: fused_add_rms_norm(x, res, w, 1e-6, out=o, lora=d),
                      (4 * T * H + T * C_SLOTS * C_RANK) * 2 + used * H * C_RANK * 2))
        gu, d2 = stacked_output(T, [I, I], slots)
        o2 = torch.empty(T, I, dtype=DT, device="cuda")
        cases.append(("SiLU-and-mul", lambda: act_and_mul(gu, out=o2), lambda: act_and_mul(gu, out=o2, lora=d2),
                      (3 * T * I + T * 2 * C_SLOTS * C_RANK) * 2 + used * 2 * I * C_RANK * 2))
        qkv, d3 = stacked_output(T, [HEADS * D] * 3, slots)
        q, k, v = (t.view(T, HEADS, D) for t in qkv.split(HEADS * D, dim=-1))
        cs = torch.randn(4096, D, dtype=torch.float32, device="cuda")
        pos = torch.randint(0, 4096, (T,), device="cuda")
        cases.append(("rotary", lambda: apply_rotary(q, k, cs, pos),
                      lambda: apply_rotary(q, k, cs, pos, v=v, lora=d3),
                      (6 * T * HEADS * D + T * 3 * C_SLOTS * C_RANK) * 2 + used * 3 * HEADS * D * C_RANK * 2))
        for op, plain, lora, nbytes in cases:
            t_plain, t_lora = bench_graph(plain, rep=100), bench_graph(lora, rep=100)
            rows.append(dict(op=op, T=T, slots=pattern, plain_us=t_plain, lora_us=t_lora,
                             lora_over_plain=t_lora / t_plain,
                             lora_fraction_of_hbm=nbytes / (t_lora * 1e-6) / peak))
            print(f"{op:13} {T:5} {pattern:10} {t_plain:9.2f} {t_lora:9.2f} {t_lora / t_plain:8.2f} "
                  f"{rows[-1]['lora_fraction_of_hbm']:7.1%}")
    return rows


# ---- attention -------------------------------------------------------------------------------
BS = 16


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


def decode_case(B, ctx_lens, Hq, Hkv, max_blocks, peak, num_splits=None, tuning=None) -> dict:
    from batchrun.kernels.paged_attention import paged_decode_attention
    from batchrun.kernels.reference import ref_paged_decode_attention
    kc, vc, tables = paged_cache(ctx_lens, Hkv, max_blocks)
    q = torch.randn(B, Hq, D, dtype=DT, device="cuda")
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    run = lambda: paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5, out,  # noqa: E731
                                         num_splits=num_splits, tuning=tuning)
    try:
        run()
        err = rel_err(out, ref_paged_decode_attention(q, kc, vc, tables, lens, D ** -0.5))
        t = bench_graph(run)
    except Exception as e:  # noqa: BLE001 - a sweep config may exceed shared memory / registers
        return dict(op="decode_attention", B=B, tuning=tuning, error=f"{type(e).__name__}: {str(e)[:200]}")
    nbytes = 2 * sum(ctx_lens) * Hkv * D * 2 + 2 * q.numel() * 2 + tables.numel() * 4
    return dict(op="decode_attention", B=B, ctx_avg=sum(ctx_lens) / B, Hq=Hq, Hkv=Hkv, us=round(t, 2),
                fraction_of_hbm=round(nbytes / (t * 1e-6) / peak, 3), num_splits=num_splits,
                tuning=tuning, rel_err=err)


def prefill_case(seqs, Hq, Hkv, tuning=None) -> dict:
    """seqs: (cached, new) tokens per sequence."""
    from batchrun.kernels.prefill_attention import prefill_attention
    from batchrun.kernels.reference import ref_prefill_attention
    ctx = [c + n for c, n in seqs]
    q_lens = [n for _, n in seqs]
    kc, vc, tables = paged_cache(ctx, Hkv, triton.cdiv(max(ctx), BS))
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, dtype=DT, device="cuda")
    qs = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    run = lambda: prefill_attention(q, kc, vc, tables, qs, ctx_t, max(q_lens), D ** -0.5, out,  # noqa: E731
                                    tuning=tuning)
    try:
        run()
        err = rel_err(out, ref_prefill_attention(q, kc, vc, tables, qs, ctx_t, D ** -0.5))
        t = bench_eager(run)
    except Exception as e:  # noqa: BLE001
        return dict(op="prefill_attention", tuning=tuning, error=f"{type(e).__name__}: {str(e)[:200]}")
    # causal: query at position p sees p + 1 keys; 2 dots of 2*D flops per (query, key, head)
    pairs = sum(sum(range(c + 1, c + n + 1)) for c, n in seqs)
    return dict(op="prefill_attention", seqs=len(seqs), new_tokens=T, cached_tokens=sum(c for c, _ in seqs),
                Hq=Hq, Hkv=Hkv, us=round(t, 1), TFLOPs=round(4 * D * Hq * pairs / (t * 1e-6) / 1e12, 1),
                tuning=tuning, rel_err=err)


def run_attention(a) -> list[dict]:
    from batchrun.kernels.paged_attention import _num_sms, decode_num_splits
    peak, rows = hbm(), []
    print(f"{torch.cuda.get_device_name()}; RANDOM bf16 K/V, head_dim {D}, page size {BS}")
    gen = torch.Generator().manual_seed(0)
    even = [384] * 256
    spread = torch.randint(320, 449, (256,), generator=gen).tolist()  # ~384 on average
    for (Hq, Hkv), lens in itertools.product([(32, 32), (32, 8)], (even, spread)):
        rows.append(decode_case(256, lens, Hq, Hkv, 2048 // BS, peak))
    if a.sweep:
        for bn, w, st in itertools.product([32, 64, 128], [4, 8], [2, 3]):
            rows.append(decode_case(256, even, 32, 32, 2048 // BS, peak,
                                    tuning=dict(block_n=bn, num_warps=w, num_stages=st)))
    sms = _num_sms(torch.cuda.current_device())
    for B, ctx, (Hq, Hkv) in itertools.product([1, 8, 32], [1024, 4096], [(32, 32), (32, 8)]):
        pick = decode_num_splits(B * Hkv, 4096, sms)  # the heuristic's split count
        for s in sorted({1, 2, 4, 8, 16, pick}) if a.sweep else sorted({1, pick}):
            rows.append({**decode_case(B, [ctx] * B, Hq, Hkv, 4096 // BS, peak, num_splits=s),
                         "heuristic_pick": pick})
    cases = {"8x32": [(0, 32)] * 8, "256x256": [(0, 256)] * 256,
             "chunked 4x(1024 cached + 512 new)": [(1024, 512)] * 4}
    for (name, seqs), (Hq, Hkv) in itertools.product(cases.items(), [(32, 32), (32, 8)]):
        rows.append({**prefill_case(seqs, Hq, Hkv), "case": name})
    if a.sweep:
        for bm, bn, w, st in itertools.product([64, 128], [32, 64], [4, 8], [2, 3]):
            rows.append({**prefill_case(cases["256x256"], 32, 32,
                                        tuning=dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)),
                         "case": "256x256"})
    for r in rows:
        if "error" in r:
            print(f"{r['op']:18} {r.get('tuning')}: {r['error']}")
        elif r["op"] == "decode_attention":
            print(f"decode  B={r['B']:<4} ctx~{r['ctx_avg']:<6.0f} {r['Hq']}/{r['Hkv']:<3} splits "
                  f"{r['num_splits']} {r['us']:9.2f} µs ({r['fraction_of_hbm']:.1%})  rel err "
                  f"{r['rel_err']:.1e}{'  ' + str(r['tuning']) if r['tuning'] else ''}")
        else:
            print(f"prefill {r['case']:34} {r['Hq']}/{r['Hkv']:<3} {r['us']:9.1f} µs {r['TFLOPs']:6.1f} "
                  f"TFLOP/s  rel err {r['rel_err']:.1e}{'  ' + str(r['tuning']) if r['tuning'] else ''}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("gemm", help="decode GEMMs: cuBLAS vs the skinny GEMMs, weights cold")
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--sweep", action="store_true", help="also time other launch configs")
    p = sub.add_parser("fp8", help="FP8 decode GEMMs: torch._scaled_mm vs fp8_gemm, weights cold")
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--sweep", action="store_true", help="also time other launch configs")
    p = sub.add_parser("lora", help="LoRA shrink / expand kernels")
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--active-slots", type=int, default=4)
    p = sub.add_parser("consumers", help="kernels that add a LoRA delta, against their plain form")
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 256, 8192])
    p = sub.add_parser("attention", help="paged decode and varlen prefill attention")
    p.add_argument("--sweep", action="store_true", help="also time launch configs")
    for p in sub.choices.values():
        p.add_argument("--json", help="also write the rows, command, commit and card here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py times CUDA kernels; the CPU tests are tests/kernels/")
    torch.manual_seed(0)
    rows = {"gemm": run_gemm, "fp8": run_fp8, "lora": run_lora, "consumers": run_consumers,
            "attention": run_attention}[a.what](a)
    write_json(a.json, {**environment(torch.device("cuda"), " ".join(["benchmarks/kernels.py", *sys.argv[1:]])),
                        "benchmark": f"kernels {a.what}", "weights": "random", "rows": rows})


if __name__ == "__main__":
    main()
