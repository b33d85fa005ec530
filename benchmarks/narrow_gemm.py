"""Decode GEMMs of few rows on the NARROW weights (o_proj, down_proj: N = 4096), with the weights
cold in L2 as in a real step: cuBLAS against kernels/skinny_gemm.py, plain and split-K.

Why: in a b8 decode step (benchmarks/lora_step_breakdown.py, H100, 2026-12-06) cuBLAS took
1525 µs for the 32 layers' o and down GEMMs plus 120 µs of split-K reduce launches, against a
1181 µs weight-streaming floor (72 %), while the Triton skinny GEMM streams qkv and gate_up at
82-83 %. benchmarks/skinny_gemm.py, which chose cuBLAS for these shapes, timed one weight over
and over: o's 33.5 MB then sits in the 50 MB L2, and its figures flatter every kernel. Here each
case runs over enough copies of the weight (>= 512 MB) that every GEMM reads its weight from
HBM, inside one CUDA graph, and the time per GEMM is the graph's over the copies.

    PYTHONPATH=. python3 benchmarks/narrow_gemm.py [--m 1 8 16] [--json out.json]

The JSON's "tuned" ("N,K" -> [config, split_k]) has the engine's entry for each narrow shape whose
best Triton case, summed over the Ms, beats cuBLAS: the form of kernels/skinny_gemm.SPLIT_TUNED,
which `async_ab.py --switch narrow_skinny --narrow-configs out.json` loads.

RANDOM bf16 weights. CPU (TRITON_INTERPRET=1): tests/kernels/test_skinny_gemm.py.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from batchrun.bench.record import environment, write_json
from batchrun.bench.roofline import hbm_peak
from batchrun.engine.step_plan import MIN_WEIGHT_ELEMENTS
from batchrun.kernels.skinny_gemm import CONFIG, skinny_gemm
from benchmarks.skinny_gemm import bench  # one case, timed inside a CUDA graph, µs

SHAPES = {"7b o": (4096, 4096), "7b down": (4096, 11008),
          "7b qkv": (12288, 4096)}  # qkv: a wide weight the engine already streams in Triton
# (BLOCK_N, BLOCK_K, num_stages, num_warps) x split_k
CONFIGS = [CONFIG, (32, 256, 4, 4), (16, 256, 4, 4), (64, 128, 5, 4)]
SPLITS = (1, 2, 3, 4)
cases_config = {f"triton {c} split {s}": (c, s) for c in CONFIGS for s in SPLITS}
COLD_BYTES = 512 << 20


def cold_copies(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Random [n, k] weights, enough copies (>= COLD_BYTES) that a GEMM over each in turn reads
    every one from HBM, not L2: time a case over all of them and divide by len()."""
    copies = max(2, -(-COLD_BYTES // (n * k * dtype.itemsize)))
    return [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(copies)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--json")
    a = ap.parse_args()
    dev_name = torch.cuda.get_device_name()
    hbm = hbm_peak(dev_name)
    dt, rows, best, per_shape, tuned = torch.bfloat16, [], {}, {}, {}
    print(f"{dev_name}; RANDOM bf16 weights; µs per GEMM with the weight cold in L2 "
          f"(fraction of {hbm / 1e12:.2f} TB/s)")
    for name, (n, k) in SHAPES.items():
        ws = cold_copies(n, k, dt)
        copies = len(ws)
        for m in a.m:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = F.linear(x, ws[0]).float()
            nbytes = (n * k + m * k + m * n) * 2

            def over_copies(f):
                return lambda: [f(w) for w in ws]
            cases = {"cublas": over_copies(lambda w: F.linear(x, w))}
            for c in CONFIGS:
                for s in SPLITS:
                    cases[f"triton {c} split {s}"] = over_copies(
                        lambda w, c=c, s=s: skinny_gemm(x, w, config=c, split_k=s))
            res, totals = {}, per_shape.setdefault(name, {})
            for label, fn in cases.items():
                try:
                    y = fn()[0].float()
                    err = (y - ref).abs().max().item() / ref.abs().max().item()
                    us = bench(fn) / copies
                except Exception as e:  # noqa: BLE001 - a config may exceed shared memory
                    rows.append({"gemm": name, "m": m, "case": label, "error": str(e)[:200]})
                    continue
                res[label] = us
                totals[label] = totals.get(label, 0.0) + us
                rows.append({"gemm": name, "m": m, "n": n, "k": k, "case": label, "us": us,
                             "fraction_of_hbm": nbytes / (us * 1e-6) / hbm, "rel_err": err})
            # the hot-L2 figure of cuBLAS, for how far benchmarks/skinny_gemm.py's flattered
            hot = bench(lambda: F.linear(x, ws[0]))
            tri = min((v, lab) for lab, v in res.items() if lab != "cublas")
            best[f"{name} M={m}"] = {"cublas_us": res["cublas"], "cublas_hot_us": hot,
                                     "best_us": tri[0], "best": tri[1]}
            for lab in sorted(res, key=res.get)[:4] + ["cublas"]:
                print(f"{name:<9}M={m:<3}{lab:<42}{res[lab]:8.2f} µs "
                      f"({nbytes / (res[lab] * 1e-6) / hbm:6.1%})")
            print(f"{name:<9}M={m:<3}{'cublas, one weight (L2 hot)':<42}{hot:8.2f} µs")
        del ws
    # the engine's entry per narrow shape: the Triton case of least total time over the Ms, if
    # that beats cuBLAS's total (else no entry: the shape stays on cuBLAS)
    for name, totals in per_shape.items():
        n, k = SHAPES[name]
        if "cublas" not in totals or n * k >= MIN_WEIGHT_ELEMENTS:
            continue
        lab = min((lab for lab in totals if lab != "cublas"), key=totals.get, default=None)
        if lab is not None and totals[lab] < totals["cublas"]:
            tuned[f"{n},{k}"] = cases_config[lab]
            print(f"{name}: engine entry {cases_config[lab]} ({totals[lab]:.1f} vs cuBLAS "
                  f"{totals['cublas']:.1f} µs summed over M = {a.m})")
        else:
            print(f"{name}: cuBLAS stays ({totals['cublas']:.1f} µs summed over M = {a.m})")
    print("\nsummary (µs per GEMM, cold weights):")
    for key, v in best.items():
        print(f"{key:<16} cuBLAS {v['cublas_us']:7.2f}  best Triton {v['best_us']:7.2f} "
              f"({v['best_us'] / v['cublas_us']:.3f} x)  {v['best']}")
    for m in a.m:
        o, d = best.get(f"7b o M={m}"), best.get(f"7b down M={m}")
        if o and d:
            cub = 32 * (o["cublas_us"] + d["cublas_us"])
            tri = 32 * (o["best_us"] + d["best_us"])
            print(f"M={m}: a 7b step's 32 o + down GEMMs: cuBLAS {cub:.0f} µs, best Triton "
                  f"{tri:.0f} µs ({tri - cub:+.0f} µs)")
    write_json(a.json, {**environment(torch.device("cuda"), " ".join(sys.argv)),
                        "weights": "random", "rows": rows, "best": best, "tuned": tuned})


if __name__ == "__main__":
    main()
