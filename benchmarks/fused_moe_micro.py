"""The fused MoE op (kernels/fused_moe.py) on CUDA at Qwen3-30B-A3B's expert shapes (H=2048,
I=768, E=128, k=8), RANDOM bf16 weights and uniform random routing (top-k of random logits),
at T = 1, 8, 64, 2048 tokens by default.

    PYTHONPATH=. python3 benchmarks/fused_moe_micro.py [--tokens 1 8 64 2048] [--sweep] [--json F]

Each case prints µs per call, the bytes of the experts it must read (every expert some token
routes to: its gate_up and down weights once, plus x and the output) over that time as GB/s
and as a fraction of the card's HBM peak (batchrun/bench/roofline.py), TFLOP/s against the bf16
peak (2 * T * k * 3 * H * I), and the error against ref_fused_moe (relative, fp32 norm). The
default path (the static rule) runs, and at T * k <= DECODE_MAX_SLOTS the sorted path too, to
show what the decode path buys. --sweep also times other (BLOCK_N, BLOCK_K, stages, warps).

Weights are cold in L2 as in a real step: a case cycles over enough copies of the layer's
experts (each with its own routing) that the selected bytes exceed COLD_BYTES, inside one
CUDA graph (triton.testing.do_bench_cudagraph: the engine replays decode steps from graphs, so
launch gaps are excluded), and its time is the graph's over the copies.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from batchrun.bench.record import environment, write_json
from batchrun.bench.roofline import bf16_peak, hbm_peak
from batchrun.kernels.fused_moe import DECODE_MAX_SLOTS, fused_moe, use_decode_path
from batchrun.kernels.reference import ref_fused_moe

DT = torch.bfloat16
H, I, E, K = 2048, 768, 128, 8     # Qwen3-30B-A3B: hidden, moe_intermediate, experts, top-k
COLD_BYTES = 512 << 20
SWEEP_CONFIGS = [(16, 256, 4, 4), (32, 256, 3, 4), (64, 128, 3, 4), (64, 64, 4, 4),
                 (128, 64, 3, 8), (128, 128, 3, 8)]


def routing(T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.topk(torch.randn(T, E, generator=gen), K, dim=-1)
    return weights.softmax(-1).cuda(), ids.to(torch.int32).cuda()


def expert_bytes(ids: torch.Tensor, T: int) -> int:
    used = int(ids.unique().numel())
    return used * 3 * H * I * DT.itemsize + 2 * T * H * DT.itemsize


def run(a) -> list[dict]:
    name = torch.cuda.get_device_name()
    peak, flops_peak = hbm_peak(name), bf16_peak(name)
    if peak is None or flops_peak is None:
        sys.exit(f"no HBM / bf16 peak known for {name!r}: add it to batchrun/bench/roofline.py")
    print(f"{name}; RANDOM bf16 weights at H={H} I={I} E={E} k={K}, cold in L2; µs per call")
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer_bytes = E * 3 * H * I * DT.itemsize
    rows = []
    for T in a.tokens:
        x = torch.randn(T, H, generator=gen).to(DT).cuda()
        probe = routing(T, gen)[1]
        copies = max(2, -(-COLD_BYTES // expert_bytes(probe, T)))
        copies = min(copies, max(2, (a.max_weight_gb << 30) // layer_bytes))
        layers = [(torch.randn(E, 2 * I, H, device="cuda", dtype=DT) * H ** -0.5,
                   torch.randn(E, H, I, device="cuda", dtype=DT) * I ** -0.5, *routing(T, gen))
                  for _ in range(copies)]
        nbytes = sum(expert_bytes(ids, T) for *_, ids in layers) / copies
        flops = 2 * T * K * 3 * H * I
        w_gu, w_d, tw, ids = layers[0]
        ref = ref_fused_moe(x, w_gu, w_d, tw, ids)
        paths = ["default"] + (["sorted"] if T * K <= DECODE_MAX_SLOTS else [])
        cases = [(p, None) for p in paths]
        if a.sweep:
            cases += [(p, c) for p in paths for c in SWEEP_CONFIGS]
        for p, config in cases:
            path = None if p == "default" else p
            taken = p if path else ("decode" if use_decode_path(T, K) else "sorted")

            def call(path=path, config=config):
                return [fused_moe(x, *layer, path=path, config=config) for layer in layers]

            label = f"{taken}{'' if config is None else ' ' + str(config)}"
            try:
                out = fused_moe(x, w_gu, w_d, tw, ids, path=path, config=config)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                call()
                torch.cuda.synchronize()
                us = triton.testing.do_bench_cudagraph(call, rep=100) * 1e3 / copies
            except Exception as e:  # noqa: BLE001 - a sweep config may exceed shared memory
                print(f"T={T:<5d} {label:28s} failed: {str(e)[:200]}")
                rows.append({"T": T, "case": label, "error": str(e)[:200]})
                continue
            rate = nbytes / (us * 1e-6)
            row = {"T": T, "case": label, "path": taken, "config": config, "us": round(us, 2),
                   "expert_bytes": int(nbytes), "gb_per_s": round(rate / 1e9, 1),
                   "fraction_of_hbm": round(rate / peak, 3),
                   "tflops": round(flops / (us * 1e-6) / 1e12, 1),
                   "fraction_of_bf16_peak": round(flops / (us * 1e-6) / flops_peak, 3),
                   "rel_err_vs_ref": err, "copies": copies}
            rows.append(row)
            print(f"T={T:<5d} {label:28s} {us:9.2f} µs  {rate / 1e9:7.1f} GB/s "
                  f"({rate / peak:6.1%} of HBM)  {row['tflops']:6.1f} TFLOP/s "
                  f"({row['fraction_of_bf16_peak']:6.1%})  rel err {err:.1e}")
        del layers
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 2048])
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP_CONFIGS")
    ap.add_argument("--max-weight-gb", type=int, default=24,
                    help="cap on the weight copies held at once (GiB)")
    ap.add_argument("--json", help="also write the rows, command, commit and card here")
    a = ap.parse_args()
    rows = run(a)
    write_json(a.json, {**environment(torch.device("cuda"),
                                      " ".join(["benchmarks/fused_moe_micro.py", *sys.argv[1:]])),
                        "shapes": {"H": H, "I": I, "E": E, "k": K, "dtype": "bf16"}, "rows": rows})


if __name__ == "__main__":
    main()
