"""An engine switch on and off on ONE engine, rounds interleaved (the order flips every
round), so host noise and clock drift hit both alike: the latency workload (`bench latency`'s:
batch 8, in 32, out 128) and the offline one (`bench throughput --preset 7b`'s: 1024 x
(256 -> 128), max_num_seqs 256, max_num_batched_tokens 8192), the engine alone. RANDOM weights.

    PYTHONPATH=. python3 benchmarks/async_ab.py [--switch async_scheduling] [--model llama-2-7b]
        [--latency-rounds 10] [--offline-rounds 2] [--output-json FILE]
        [--narrow-configs narrow_gemm.json]

Switches: `async_scheduling` (the step loop; flipped between calls), `triton_decode_gemm` (the
GEMM of steps of <= 16 rows) and `pdl` (programmatic dependent launch of the Triton kernels);
captured graphs hold the kernels and their launches of those two and of `narrow_skinny`
(o_proj and down_proj of steps of <= 16 rows in the split-K skinny GEMM with the entries of
narrow_gemm.py's JSON, `--narrow-configs`, against cuBLAS), so the engine captures one decode
graph set per setting and swaps them (the prefill graphs are captured with whatever was set
last). `prefill_graphs`: small prefill steps
replay the piecewise graphs or run eagerly (the offline workload's 8192-token prefills are
eager either way). The official figures stay `batchrun bench latency` / `bench throughput`;
this script measures a difference of a few percent.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from batchrun.bench.build import build_engine, make_requests, random_prompts
from batchrun.bench.record import environment, write_json
from batchrun.bench.timing import time_generate
from batchrun.engine.config import EngineConfig
from benchmarks.tuned import load_tuned

STAT_KEYS = ("decode_steps", "decode_s", "decode_host_s", "prefill_s", "prefill_steps")


def switcher(engine, name: str, narrow_configs: str | None = None):
    """set(on) for the engine switch `name`."""
    if name == "async_scheduling":
        return lambda on: setattr(engine.config, "async_scheduling", on)
    if name == "prefill_graphs":  # off: the captured pieces stay, prefill steps run eagerly
        runner, captured = engine.runner, engine.runner.prefill_graphs
        if captured is None:
            raise SystemExit("the engine captured no prefill graphs (CUDA and "
                             "engine.prefill_graph_max_tokens > 0 needed)")
        print(f"prefill graphs: {captured.stats}", flush=True)
        return lambda on: setattr(runner, "_prefill_graphs", captured if on else None)
    from batchrun.kernels.pdl import set_pdl
    from batchrun.kernels.skinny_gemm import set_split_tuned
    narrow = load_tuned(narrow_configs) if narrow_configs else {}
    flip = {"triton_decode_gemm": lambda on: setattr(engine.runner, "_triton_gemm", on),
            "narrow_skinny": lambda on: set_split_tuned(narrow if on else {}),
            "pdl": set_pdl}[name]
    runner, sets = engine.runner, {}
    for on in (True, False):  # decode graphs capture the kernels and launches: a set per setting
        flip(on)
        runner._graphs = None
        runner.capture_graphs()
        sets[on] = runner._graphs

    def set_(on: bool) -> None:
        flip(on)
        runner._graphs = sets[on]
    return set_


def timed(engine, reqs, set_, on: bool, check_len: int) -> tuple[float, dict]:
    set_(on)
    before = dict(engine.stats)
    t = time_generate(engine, reqs, check_len=check_len)
    return t, {k: engine.stats[k] - before[k] for k in STAT_KEYS}


def ab(engine, set_, rounds: int, make, check_len: int, log) -> dict:
    """`rounds` rounds of (on, off) or (off, on) on the same requests; medians and ratios."""
    runs = {True: [], False: []}
    for r in range(rounds):
        reqs = make(r)
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            t, st = timed(engine, reqs, set_, on, check_len)
            runs[on].append({"s": t, **st})
        log(f"  round {r + 1}/{rounds}: on {runs[True][-1]['s']:.4f} s, off {runs[False][-1]['s']:.4f} s")
    med = {on: statistics.median(x["s"] for x in runs[on]) for on in runs}
    ratios = [a["s"] / b["s"] for a, b in zip(runs[True], runs[False])]
    return {"on": runs[True], "off": runs[False], "median_on_s": med[True], "median_off_s": med[False],
            "median_ratio_on_over_off": statistics.median(ratios), "ratios": ratios}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--switch", choices=["async_scheduling", "triton_decode_gemm", "pdl",
                                         "prefill_graphs", "narrow_skinny"],
                    default="async_scheduling")
    ap.add_argument("--model", default="llama-2-7b")
    ap.add_argument("--latency-rounds", type=int, default=10)
    ap.add_argument("--offline-rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--narrow-configs", default=None,
                    help="narrow_gemm.py's JSON: the split-K skinny entries --switch "
                         "narrow_skinny turns on")
    a = ap.parse_args()
    if a.switch == "narrow_skinny" and not a.narrow_configs:  # before the 7b engine is built
        ap.error("--switch narrow_skinny needs --narrow-configs (narrow_gemm.py's JSON)")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    cfg = EngineConfig(model=a.model, max_num_seqs=256, max_num_batched_tokens=8192,
                       max_model_len=384, enable_prefix_caching=False)
    built = build_engine(cfg)
    engine = built.engine
    vocab = engine.model.config.vocab_size
    log(f"*** RANDOM WEIGHTS ({a.model} shape) *** engine built in {built.build_s:.1f} s")
    set_ = switcher(engine, a.switch, a.narrow_configs)
    lat = lambda r: make_requests(random_prompts(8, 32, vocab, 1000 + r), 128, tag=f"l{r}-")  # noqa: E731
    off = lambda r: make_requests(random_prompts(a.num_prompts, 256, vocab, 2000 + r), 128, tag=f"o{r}-")  # noqa: E731
    for on in (True, False):  # warm-up: every graph size and kernel once in each loop
        timed(engine, lat(-1), set_, on, 128)
        timed(engine, make_requests(random_prompts(64, 256, vocab, 7), 16, tag="w"), set_, on, 16)
    latency = None
    if a.latency_rounds:
        log("latency workload (batch 8, in 32, out 128):")
        latency = ab(engine, set_, a.latency_rounds, lat, 128, log)
    offline = None
    if a.offline_rounds:
        log(f"offline workload ({a.num_prompts} x (256 -> 128), engine alone):")
        offline = ab(engine, set_, a.offline_rounds, off, 128, log)
    tokens = a.num_prompts * (256 + 128)
    result = {"benchmark": "async_ab", "switch": a.switch, "weights": built.weights, "model": a.model,
              **environment(engine.device, " ".join(sys.argv)), "latency": latency, "offline": offline}
    if a.switch == "narrow_skinny":
        result["narrow_configs"] = a.narrow_configs
    if offline:
        result["offline_tok_s"] = {"on": tokens / offline["median_on_s"],
                                   "off": tokens / offline["median_off_s"]}
    write_json(a.output_json, result)
    print(f"{a.switch}: {'workload':<28}{'on':>12}{'off':>12}{'on/off':>10}")
    if latency:
        print(f"{'latency b8 (s)':<28}{latency['median_on_s']:>12.4f}{latency['median_off_s']:>12.4f}"
              f"{latency['median_ratio_on_over_off']:>10.4f}")
    if offline:
        print(f"{f'offline {a.num_prompts} (s)':<28}{offline['median_on_s']:>12.3f}"
              f"{offline['median_off_s']:>12.3f}{offline['median_ratio_on_over_off']:>10.4f}")
        print(f"{'offline tok/s':<28}{result['offline_tok_s']['on']:>12.0f}"
              f"{result['offline_tok_s']['off']:>12.0f}")
    for name, res in (("latency", latency), ("offline", offline)):
        if not res:
            continue
        for on in ("on", "off"):
            st = res[on][-1]
            if st["decode_steps"]:
                print(f"{name} {on}: decode {1e3 * st['decode_s'] / st['decode_steps']:.3f} ms/step, host "
                      f"{1e3 * st['decode_host_s'] / st['decode_steps']:.3f} ms/step ({st['decode_steps']} steps)")


if __name__ == "__main__":
    main()
