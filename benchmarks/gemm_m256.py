"""The GEMMs of a throughput decode step (M = 192-256 rows): cuBLAS (F.linear) against
kernels/full_rows_gemm.py over a sweep of its tiles, for the Llama-2-7b shapes. Each case is
timed inside a CUDA graph (decode replays them) and checked against cuBLAS; the table gives
µs, TFLOP/s and the fraction of the case's floor (the larger of its FLOPs at the bf16 dense
peak and its bytes at the HBM peak), and the summary prices one decode step's GEMMs (32 layers
of qkv, o, gate_up, down, plus lm_head) with cuBLAS against the best config per shape.

    PYTHONPATH=. python3 benchmarks/gemm_m256.py [--m 256 192] [--json out.json]

The JSON's "tuned" maps "N,K" to the best config at the largest M: the form of
kernels/full_rows_gemm.TUNED, which `async_ab.py --full-rows-configs out.json` loads.

RANDOM bf16 weights. CPU (TRITON_INTERPRET=1): tests/kernels/test_full_rows_gemm.py.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from batchrun.bench.record import environment, write_json
from batchrun.bench.roofline import bf16_peak, hbm_peak
from batchrun.kernels.full_rows_gemm import CONFIG, full_rows_gemm
from benchmarks.skinny_gemm import bench  # one case, timed inside a CUDA graph, µs

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
          "down": (4096, 11008), "lm_head": (32000, 4096)}
LAYERS = 32
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_stages, num_warps)
WIDE = [CONFIG, (256, 128, 64, 1, 4, 8), (256, 64, 64, 1, 3, 8), (256, 64, 64, 1, 4, 4),
        (256, 256, 64, 1, 3, 8), (128, 128, 64, 1, 3, 8), (128, 128, 64, 1, 4, 4),
        (128, 256, 64, 1, 3, 8), (256, 128, 32, 1, 4, 8), (256, 128, 128, 1, 2, 8),
        (256, 64, 128, 1, 2, 8)]
NARROW = [(256, 128, 64, 2, 3, 8), (256, 128, 64, 4, 3, 8), (256, 64, 64, 2, 3, 8),
          (128, 128, 64, 4, 3, 8), (256, 128, 64, 3, 4, 8)]  # split-K, for N = 4096


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[256, 192])
    ap.add_argument("--json")
    a = ap.parse_args()
    dev_name = torch.cuda.get_device_name()
    hbm, peak = hbm_peak(dev_name), bf16_peak(dev_name)
    dt, rows, summary, tuned = torch.bfloat16, [], {}, {}
    print(f"{dev_name}; RANDOM bf16 weights; µs in a CUDA graph (TFLOP/s, fraction of floor)")
    for m in a.m:
        step = {"cublas": 0.0, "best": 0.0}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=dt) * 0.02
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = F.linear(x, w).float()
            flops, nbytes = 2.0 * m * n * k, (n * k + m * k + m * n) * 2
            floor_us = max(flops / peak, nbytes / hbm) * 1e6 if peak and hbm else None
            cases, configs = {"cublas": lambda: F.linear(x, w)}, {}
            for c in WIDE + (NARROW if n <= 4096 else []):
                cases[f"triton {c}"] = lambda c=c: full_rows_gemm(x, w, config=c)
                configs[f"triton {c}"] = c
            res = {}
            for label, fn in cases.items():
                try:
                    err = (fn().float() - ref).abs().max().item() / ref.abs().max().item()
                    us = bench(fn)
                except Exception as e:  # noqa: BLE001 - a config may exceed shared memory
                    rows.append({"m": m, "shape": name, "case": label, "error": str(e)[:200]})
                    continue
                res[label] = us
                row = {"m": m, "shape": name, "n": n, "k": k, "case": label, "us": us,
                       "tflops": flops / us / 1e6, "rel_err_vs_cublas": err,
                       "fraction_of_floor": floor_us / us if floor_us else None}
                rows.append(row)
                print(f"M={m:<4}{name:<8}{label:<40}{us:9.1f} µs {row['tflops']:6.0f} TF/s"
                      + (f" {row['fraction_of_floor']:6.1%}" if floor_us else "")
                      + f"  rel err {err:.1e}")
            best = min((v, k_) for k_, v in res.items() if k_ != "cublas")
            times = LAYERS if name != "lm_head" else 1
            step["cublas"] += times * res["cublas"]
            step["best"] += times * best[0]
            summary[f"M={m} {name}"] = {"cublas_us": res["cublas"], "best_us": best[0],
                                        "best": best[1]}
            if m == max(a.m):  # the engine's configs are tuned for its largest step
                tuned[f"{n},{k}"] = configs[best[1]]
        summary[f"M={m} step"] = step
        print(f"M={m}: one decode step's GEMMs: cuBLAS {step['cublas'] / 1e3:.2f} ms, best Triton "
              f"config per shape {step['best'] / 1e3:.2f} ms ({step['best'] / step['cublas']:.3f} x)")
    for key, v in summary.items():
        if "best" in v and "cublas_us" in v:
            print(f"{key:<16} cuBLAS {v['cublas_us']:8.1f} µs  best {v['best_us']:8.1f} µs  {v['best']}")
    write_json(a.json, {**environment(torch.device("cuda"), " ".join(sys.argv)),
                        "weights": "random", "rows": rows, "summary": summary, "tuned": tuned})


if __name__ == "__main__":
    main()
