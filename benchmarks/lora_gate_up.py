"""The MLP's first half on a decode step of few rows, base vs LoRA: post-attention add+RMSNorm
(with o_proj's pending LoRA delta on LoRA steps) then gate_up + SiLU-and-mul. Each case is timed
inside a CUDA graph (as decode replays it), in us, Llama-2-7b shapes, rank-16 adapters in 8
slots, RANDOM bf16 weights:

- base: the add+RMSNorm kernel, then the fused gate_up + SiLU GEMM;
- stacked: what a LoRA step ran before 52a9e41: the norm (delta kernel + norm), the Triton GEMM
  over [W; A of slots < k], silu_and_mul's LoRA kernel;
- shrink-norm: the norm computes gate_up's shrink (kernels/rms_norm_shrink.py), the fused GEMM
  adds the delta before the SiLU; at slot bound 1 with the LoRA operands loaded before the K
  loop ("prefetch") and without ("epilogue").

    PYTHONPATH=. python3 benchmarks/lora_gate_up.py [--m 8 16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

import batchrun.kernels.skinny_gate_up_silu as fused_mod
from batchrun.kernels.fused_add_rms_norm import fused_add_rms_norm
from batchrun.kernels.lora_meta import LoRADelta, LoRAShrink
from batchrun.kernels.silu_and_mul import silu_and_mul
from batchrun.kernels.skinny_gate_up_silu import skinny_gate_up_silu
from batchrun.kernels.skinny_gemm import skinny_gemm

H, I, L, R = 4096, 11008, 8, 16
PREFETCH_CASES = ("shrink-norm", "fused gate_up + delta")  # timed with and without the prefetch


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=60) * 1e3


def cases(m: int, k: int, dev="cuda", dt=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(m * 10 + k)
    rn = lambda *s, scale=1.0: (torch.randn(*s, device=dev, generator=g) * scale).to(dt)  # noqa: E731
    x, res, nw = rn(m, H), rn(m, H), rn(H, scale=0.1) + 1
    wf = rn(2 * I + L * 2 * R, H, scale=0.02)            # [W; A], slot-major (LoRALinear's layout)
    w, lora_a = wf[:2 * I], wf[2 * I:].view(L, 2, R, H).transpose(0, 1)
    b_gu, b_o = rn(L, 2 * I, R, scale=0.01), rn(L, H, R, scale=0.01)
    slots = (torch.arange(m, device=dev, dtype=torch.int32) % k)
    o_delta = LoRADelta(rn(m, k * R), b_o, slots, (0, H))          # o_proj's stacked GEMM columns
    shrunk = torch.empty(m, k * 2 * R, device=dev, dtype=dt)
    gu_delta = LoRADelta(shrunk, b_gu, slots, (0, I, 2 * I))

    def base():
        h, _ = fused_add_rms_norm(x, res, nw, 1e-5)
        return skinny_gate_up_silu(h, w)

    def stacked():
        h, _ = fused_add_rms_norm(x, res, nw, 1e-5, lora=o_delta)
        full = skinny_gemm(h, wf[:2 * I + k * 2 * R])
        return silu_and_mul(full[:, :2 * I], lora=LoRADelta(full[:, 2 * I:], b_gu, slots,
                                                             (0, I, 2 * I)))

    def shrink_norm():
        h, _ = fused_add_rms_norm(x, res, nw, 1e-5, lora=o_delta,
                                  shrink=LoRAShrink(lora_a, slots, shrunk))
        return skinny_gate_up_silu(h, w, lora=gu_delta)

    def parts():  # the pieces alone
        h, gate_up, shrunk2 = x.clone(), rn(m, 2 * I), rn(m, k * 2 * R)
        silu_delta = LoRADelta(shrunk2, b_gu, slots, (0, I, 2 * I))
        return {"norm (base)": lambda: fused_add_rms_norm(x, res, nw, 1e-5),
                "norm + o delta": lambda: fused_add_rms_norm(x, res, nw, 1e-5, lora=o_delta),
                "norm + o delta + shrink": lambda: fused_add_rms_norm(
                    x, res, nw, 1e-5, lora=o_delta, shrink=LoRAShrink(lora_a, slots, shrunk)),
                "fused gate_up (base)": lambda: skinny_gate_up_silu(h, w),
                "fused gate_up + delta": lambda: skinny_gate_up_silu(h, w, lora=gu_delta),
                "skinny [W; A]": lambda: skinny_gemm(h, wf[:2 * I + k * 2 * R]),
                "silu_and_mul lora": lambda: silu_and_mul(gate_up, lora=silu_delta)}
    return {"base": base, "stacked": stacked, "shrink-norm": shrink_norm}, parts()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}; RANDOM bf16 weights; Llama-2-7b post-attention norm "
          f"+ gate_up + SiLU, rank {R}, {L} slots; us in a CUDA graph")
    for m in a.m:
        for k in (1, L):
            whole, parts = cases(m, k)
            for prefetch in ((True, False) if k == 1 else (True,)):
                fused_mod.PREFETCH_ONE_SLOT = prefetch
                tag = "" if k > 1 else (" prefetch" if prefetch else " epilogue")
                for label, fn in list(whole.items()) + list(parts.items()):
                    if not prefetch and label not in PREFETCH_CASES:
                        continue
                    us = bench(fn)
                    name = label + (tag if label in PREFETCH_CASES else "")
                    rows.append({"M": m, "slot_bound": k, "case": name, "us": round(us, 2)})
                    print(f"M={m:<3d} k={k}  {name:34s} {us:8.2f} us")
            fused_mod.PREFETCH_ONE_SLOT = True
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
