"""Time the kernels that add a LoRA delta after each projection (add+RMSNorm after o_proj and
down_proj, SiLU-and-mul after gate_up, rotary after qkv) against their plain versions, on CUDA.

    PYTHONPATH=. python benchmarks/lora_consumers_bench.py [--tokens 256 8192] [--json F]

Llama-2-7b shapes, random bf16 data, 8 GPU slots of rank 16. Slot patterns: "1 adapter" (every
row slot 0), "8 sorted" (8 adapters, rows grouped by slot: a prefill step, or a decode step as the
engine orders it), "8 mixed" (8 adapters, rows shuffled: the worst case). Times come from
triton.testing.do_bench_cudagraph (the engine replays these kernels from CUDA graphs). GB/s
counts the bytes a kernel must move at least (its inputs and outputs, plus B of the slots in
use once), against the H200's ~4.2 TB/s achievable HBM bandwidth.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess

import torch
import triton

from batchrun.kernels.fused_add_rms_norm import fused_add_rms_norm
from batchrun.kernels.lora_meta import LoRADelta
from batchrun.kernels.rotary import apply_rotary
from batchrun.kernels.silu_and_mul import silu_and_mul

DT = torch.bfloat16
L, R = 8, 16
H, I, HEADS, D = 4096, 11008, 32, 128


def bench(fn) -> float:
    torch.cuda.synchronize()  # do_bench_cudagraph's side stream does not wait for our writes
    return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3  # us


def slots_for(T: int, pattern: str) -> torch.Tensor:
    if pattern == "1 adapter":
        s = torch.zeros(T, dtype=torch.int32)
    else:
        s = (torch.arange(T) % L).to(torch.int32)
        s = s.sort().values if pattern == "8 sorted" else s[torch.randperm(T)]
    return s.cuda()


def fused_output(T: int, sizes: list[int], slots: torch.Tensor) -> tuple[torch.Tensor, LoRADelta]:
    """(y [T, N], delta) laid out as the stacked [W; A] GEMM leaves them (one strided buffer)."""
    N, S = sum(sizes), len(sizes)
    full = torch.randn(T, N + S * L * R, dtype=DT, device="cuda")
    b = torch.randn(L, N, R, dtype=DT, device="cuda") * R ** -0.5
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + n)
    return full[:, :N], LoRADelta(full[:, N:], b, slots, tuple(offs))


def rows_for(T: int, pattern: str) -> list[dict]:
    slots = slots_for(T, pattern)
    used = len(set(slots.tolist()))
    out = []

    x, d = fused_output(T, [H], slots)
    res, w = torch.randn(T, H, dtype=DT, device="cuda"), torch.randn(H, dtype=DT, device="cuda")
    o = torch.empty(T, H, dtype=DT, device="cuda")
    out.append(("add+RMSNorm", bench(lambda: fused_add_rms_norm(x, res, w, 1e-6, out=o)),
                bench(lambda: fused_add_rms_norm(x, res, w, 1e-6, out=o, lora=d)),
                (4 * T * H + T * L * R) * 2, used * H * R * 2))

    gu, d = fused_output(T, [I, I], slots)
    o = torch.empty(T, I, dtype=DT, device="cuda")
    out.append(("SiLU-and-mul", bench(lambda: silu_and_mul(gu, o)),
                bench(lambda: silu_and_mul(gu, o, lora=d)),
                (3 * T * I + T * 2 * L * R) * 2, used * 2 * I * R * 2))

    qkv, d = fused_output(T, [HEADS * D] * 3, slots)
    q, k, v = (t.view(T, HEADS, D) for t in qkv.split(HEADS * D, dim=-1))
    cs = torch.randn(4096, D, dtype=torch.float32, device="cuda")
    pos = torch.randint(0, 4096, (T,), device="cuda")
    out.append(("rotary", bench(lambda: apply_rotary(q, k, cs, pos)),
                bench(lambda: apply_rotary(q, k, cs, pos, v=v, lora=d)),
                (6 * T * HEADS * D + T * 3 * L * R) * 2, used * 3 * HEADS * D * R * 2))
    rows = []
    for op, plain, lora, nbytes, b_bytes in out:
        rows.append(dict(op=op, T=T, slots=pattern, plain_us=plain, lora_us=lora,
                         lora_over_plain=lora / plain, lora_GBps=(nbytes + b_bytes) / lora / 1e3))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 8192])
    p.add_argument("--json", help="also write the rows (and command, commit, device) here")
    p.add_argument("--gather-max-rows", type=int, default=None,
                   help="steps of at most this many rows gather each row's B instead of the "
                        "slot loop (kernels/lora_delta.py GATHER_MAX_ROWS; default: the kernels')")
    args = p.parse_args()
    if args.gather_max_rows is not None:
        from batchrun.kernels import lora_delta
        lora_delta.GATHER_MAX_ROWS = args.gather_max_rows
    torch.manual_seed(0)
    rows = [r for T in args.tokens for pat in ("1 adapter", "8 sorted", "8 mixed")
            for r in rows_for(T, pat)]
    print(f"{'op':13} {'T':>5} {'slots':10} {'plain us':>9} {'LoRA us':>9} {'x plain':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{r['op']:13} {r['T']:5} {r['slots']:10} {r['plain_us']:9.2f} {r['lora_us']:9.2f} "
              f"{r['lora_over_plain']:8.2f} {r['lora_GBps']:6.0f}")
    if args.json:
        commit = os.environ.get("BATCHRUN_COMMIT") or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
        with open(args.json, "w") as f:
            from batchrun.kernels import lora_delta
            json.dump(dict(command="python benchmarks/lora_consumers_bench.py --tokens "
                           + " ".join(map(str, args.tokens)), commit=commit,
                           gather_max_rows=lora_delta.GATHER_MAX_ROWS,
                           device=torch.cuda.get_device_name(),
                           dtype="bfloat16 (random data)", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
