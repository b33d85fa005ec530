"""Does programmatic dependent launch (PDL, sm_90+) shorten a decode step? A probe, not an engine
path: a chain shaped like b8 Llama-2-7b decode, 32 layers of (add+RMSNorm -> W-streaming GEMM
[12288, 4096] -> add+RMSNorm -> W-streaming GEMM [22016, 4096]), captured in one CUDA graph and
timed in three forms. RANDOM bf16 weights (9 GB, so the weights stream from HBM, not L2).

- base: plain launches (what the engine does now: ~1 us of idle GPU at each kernel boundary,
  docs/benchmarks.md session 11: 326 launches, kernels 5359 us, graph 5677 us a step on an H100);
- pdl: every kernel launched with launch_pdl=True, `gdc_wait` before its first global access
  and `gdc_launch_dependents` right after, so the next kernel's launch overlaps this one;
- pdl+prefetch P: as pdl, and each GEMM program first asks L2 for the first P columns of its
  W rows (`prefetch.global.L2`, one per 128-byte line) before it waits: the weights start
  streaming while the norm before it runs (a norm at b8 is ~2 us of an idle HBM).

Prints us per layer, the saving against base, and whether the outputs are bit-equal to base
(the kernels compute the same thing in every form; a difference would mean a race).

    PYTHONPATH=. python3 benchmarks/pdl_probe.py [--prefetch 512 1024 2048] [--json out.json]

It priced PDL before the engine took it (docs/benchmarks.md, session 13); its kernels now use
the engine's own hooks (kernels/pdl.py: `pdl_enter`, `prefetch_rows_l2`), so it prices the
code the engine runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from batchrun.kernels.fused_add_rms_norm import norm_row
from batchrun.kernels.pdl import pdl_enter, prefetch_rows_l2
from batchrun.kernels.skinny_gemm import _stream_dot

H, N1, N2, M, LAYERS = 4096, 12288, 22016, 8, 32
BLOCK_N, BLOCK_K, STAGES, WARPS = 32, 128, 6, 4   # kernels/skinny_gemm.py's CONFIG


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, H, eps, stride_x, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    r = tl.load(res_ptr + row * H + offs, mask=mask, other=0.0)
    h = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(res_ptr + row * H + offs, h, mask=mask)
    tl.store(out_ptr + row * H + offs, norm_row(h, w_ptr, offs, mask, H, eps, out_ptr), mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 PREFETCH: tl.constexpr):
    rows = tl.arange(0, 16)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH > 0:  # W does not depend on the previous kernel: ask L2 for it before waiting
        prefetch_rows_l2(w_ptr, cols, stride_wn, N, K, PREFETCH)
    pdl_enter(PDL)
    acc = _stream_dot(tl.zeros((16, BLOCK_N), dtype=tl.float32), x_ptr, w_ptr, rows, cols,
                      M, N, K, stride_xm, stride_wn, BLOCK_K, True)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def make_chain(pdl: bool, prefetch: int, ws, norms, bufs):
    extra = {"launch_pdl": True} if pdl else {}

    def chain():
        res, n, y1, y2, x0 = bufs["res"], bufs["n"], bufs["y1"], bufs["y2"], bufs["x0"]
        res.copy_(bufs["res0"])
        x = x0
        for w1, w2, g1, g2 in zip(ws[0], ws[1], norms[0], norms[1]):
            for w, g, y in ((w1, g1, y1), (w2, g2, y2)):
                _norm_kernel[(M,)](x, res, g, n, H, 1e-5, x.stride(0),
                                   BLOCK=triton.next_power_of_2(H), PDL=pdl, num_warps=8, **extra)
                N = w.shape[0]
                _gemm_kernel[(triton.cdiv(N, BLOCK_N),)](
                    n, w, y, M, N, H, n.stride(0), w.stride(0), y.stride(0), BLOCK_N=BLOCK_N,
                    BLOCK_K=BLOCK_K, PDL=pdl, PREFETCH=prefetch, num_stages=STAGES,
                    num_warps=WARPS, **extra)
                x = y  # the next norm adds y[:, :H] to the residual
        return y2
    return chain


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefetch", type=int, nargs="*", default=[512, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("pdl_probe needs an sm_90+ GPU (H100 / H200)")
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [[torch.randn(n, H, device=dev, dtype=dt, generator=g) * H ** -0.5
           for _ in range(LAYERS)] for n in (N1, N2)]
    norms = [[1 + 0.1 * torch.randn(H, device=dev, dtype=dt, generator=g)
              for _ in range(LAYERS)] for _ in range(2)]
    bufs = {"x0": torch.randn(M, H, device=dev, dtype=dt, generator=g),
            "res0": torch.randn(M, H, device=dev, dtype=dt, generator=g),
            "res": torch.empty(M, H, device=dev, dtype=dt), "n": torch.empty(M, H, device=dev, dtype=dt),
            "y1": torch.empty(M, N1, device=dev, dtype=dt), "y2": torch.empty(M, N2, device=dev, dtype=dt)}
    forms = {"base": (False, 0), "pdl": (True, 0)}
    forms.update({f"pdl+prefetch {p}": (True, p) for p in a.prefetch})
    chains, outs, errors = {}, {}, {}
    for name, (pdl, pf) in forms.items():
        try:
            chains[name] = make_chain(pdl, pf, ws, norms, bufs)
            outs[name] = chains[name]().clone()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a probe: report which form cannot run and why
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            chains.pop(name, None)
            print(f"{name}: could not run: {errors[name]}", flush=True)
    times = {name: [] for name in chains}
    for r in range(a.rounds):  # forms interleaved, order rotating each round
        names = list(chains)
        for name in names[r % len(names):] + names[:r % len(names)]:
            torch.cuda.synchronize()
            times[name].append(triton.testing.do_bench_cudagraph(chains[name], rep=100) * 1e3)
            print(f"  round {r + 1}: {name} {times[name][-1] / LAYERS:.2f} us/layer", flush=True)
    base = statistics.median(times["base"]) if "base" in times else None
    print(f"{torch.cuda.get_device_name()}; RANDOM bf16 weights; {LAYERS} layers x (norm, GEMM "
          f"[{N1}, {H}], norm, GEMM [{N2}, {H}]) at M = {M} in one CUDA graph")
    rows = []
    for name in times:
        med = statistics.median(times[name])
        same = bool(torch.equal(outs[name], outs["base"])) if "base" in outs else None
        rows.append({"form": name, "us_per_layer": med / LAYERS, "median_us": med,
                     "saving_us_per_layer": None if base is None else (base - med) / LAYERS,
                     "bit_equal_to_base": same, "rounds_us": times[name]})
        print(f"{name:<22} {med / LAYERS:8.2f} us/layer   saving "
              f"{(base - med) / LAYERS if base else float('nan'):6.2f} us/layer "
              f"({(base - med) / LAYERS / 4 if base else float('nan'):5.2f} a kernel)   "
              f"bit-equal {same}")
    for name, err in errors.items():
        print(f"{name:<22} could not run: {err}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "weights": "random", "rows": rows,
                       "errors": errors, "triton": triton.__version__, "torch": torch.__version__},
                      f, indent=1)


if __name__ == "__main__":
    main()
