"""`batchrun bench lora-matrix`: what LoRA costs, every scenario in one process, A/B interleaved.

Engine A has LoRA disabled; engine B has LoRA enabled with `max_loras` random adapters loaded.
Both get the same random weights (same seed). Scenarios:

    lora_disabled             A, no adapters                      (the reference)
    lora_enabled_0_active     B, no row has an adapter            (no-LoRA graph set)
    lora_1_active             B, every row adapter lora0          (LoRA graph set)
    lora_{N}_active           B, rows round-robin over N adapters (N = max_loras)

Both engines get the same KV cache: engine A is sized from free memory (or --num-kv-blocks),
engine B is then forced to A's number of blocks (two engines sized one after the other would
otherwise give B only what A left). Each scenario counts the preemptions and recomputed tokens
of its timed iterations; a scenario whose block count or counts differ from its baseline's is
flagged not comparable (comparable.py) and gets no target verdict.

each with CUDA graphs and eagerly (latency.eager() for that iteration). Every round runs
one iteration of each scenario, in an order rotated by one per round, so slow drift (clocks,
temperature) spreads over all scenarios instead of biasing the ones measured last.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


from batchrun.bench import comparable
from batchrun.bench.lora_memory import format_lora_memory
from batchrun.bench.latency import (RANDOM_BANNER, EngineSpec, build_engine, eager, environment,
                                    graph_stats, make_requests, memory_stats, percentile,
                                    random_prompts, round_robin, sync, time_generate, write_json)

# The targets: slowdown vs LoRA disabled (graphs vs graphs), memory, capture time.
TARGETS = {"lora_enabled_0_active": 0.5, "lora_1_active": 8.0, "many_active": 15.0,
           "memory_ratio": 1.15, "capture_s": 20.0}

# --preset: vLLM's latency workload, and the offline-job batch of issue #16
PRESETS = {"latency": dict(batch_size=8, input_len=32, output_len=128, max_num_seqs=None,
                           max_num_batched_tokens=2048),
           "throughput": dict(batch_size=256, input_len=256, output_len=128, max_num_seqs=256,
                              max_num_batched_tokens=8192)}


def apply_preset(values: dict, explicit: set[str]) -> dict:
    """values with the preset's settings for every key not given explicitly on the command line."""
    name = values.get("preset")
    if name is None:
        return values
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {name!r}")
    return {**values, **{k: v for k, v in PRESETS[name].items() if k not in explicit}}


@dataclass
class MatrixParams:
    model: str = "llama-2-7b"
    batch_size: int = 8
    input_len: int = 32
    output_len: int = 128
    num_iters_warmup: int = 3
    num_iters: int = 15
    num_iters_eager: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_loras: int = 8
    max_lora_rank: int = 16
    lora_rank: int = 16
    enforce_eager: bool = False
    no_eager: bool = False
    profile_kernels: bool = False
    seed: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None  # both engines; None: A sized from free memory, B = A's
    preset: str | None = None  # recorded; the CLI applies it (apply_preset)
    output_json: str | None = None

    def check(self) -> None:
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"--num-kv-blocks must be >= 2, got {self.num_kv_blocks}")
        for name in ("batch_size", "input_len", "output_len", "num_iters", "max_loras",
                     "lora_rank", "max_lora_rank", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_iters_warmup < 0 or (self.num_iters_eager is not None and self.num_iters_eager < 0):
            raise ValueError("--num-iters-warmup and --num-iters-eager must be >= 0")
        if self.lora_rank > self.max_lora_rank:
            raise ValueError(f"--lora-rank {self.lora_rank} is above --max-lora-rank {self.max_lora_rank}")
        if self.enforce_eager and self.no_eager:
            raise ValueError("--enforce-eager and --no-eager together leave nothing to run")

    def spec(self, enable_lora: bool, num_kv_blocks: int | None = None) -> EngineSpec:
        return EngineSpec(model=self.model, device=self.device, dtype=self.dtype, seed=self.seed,
                          enable_lora=enable_lora, max_loras=self.max_loras,
                          max_lora_rank=self.max_lora_rank, lora_rank=self.lora_rank,
                          num_adapters=self.max_loras if enable_lora else 0,
                          enforce_eager=self.enforce_eager,
                          max_num_seqs=self.max_num_seqs or max(64, self.batch_size),
                          max_model_len=self.input_len + self.output_len,
                          max_num_batched_tokens=self.max_num_batched_tokens,
                          num_kv_blocks=num_kv_blocks or self.num_kv_blocks)


@dataclass
class Scenario:
    name: str
    engine: str  # "A" (LoRA disabled) | "B" (LoRA enabled)
    graphs: bool
    active: int  # adapters used by the batch
    base: str  # the scenario this one is compared with
    iters: int


def scenarios(p: MatrixParams, have_graphs: bool) -> list[Scenario]:
    many = f"lora_{p.max_loras}_active"
    core = [("lora_disabled", "A", 0), ("lora_enabled_0_active", "B", 0),
            ("lora_1_active", "B", 1)]
    if p.max_loras > 1:
        core.append((many, "B", p.max_loras))
    modes = []
    if have_graphs:
        modes.append((True, "", p.num_iters))
    if not p.no_eager or not have_graphs:
        n_eager = p.num_iters if p.num_iters_eager is None or not have_graphs else p.num_iters_eager
        modes.append((False, "_eager" if have_graphs else "", n_eager))
    out = []
    for graphs, suffix, iters in modes:
        for name, eng, k in core:
            out.append(Scenario(name + suffix, eng, graphs, k, "lora_disabled" + suffix, iters))
    return out


def _run_one(engine, sc: Scenario, reqs, check_len=None) -> tuple[float, int, int]:
    """(seconds, preemptions, recomputed tokens) of one generate call."""
    before = dict(engine.stats)
    with eager(engine, on=not sc.graphs):  # eager for this iteration only
        dt = time_generate(engine, reqs, check_len)
    return (dt, engine.stats["preemptions"] - before["preemptions"],
            engine.stats.get("recomputed_tokens", 0) - before.get("recomputed_tokens", 0))


def run_matrix(p: MatrixParams, log=print, command: str | None = None) -> dict:
    p.check()
    with tempfile.TemporaryDirectory(prefix="batchrun-lora-matrix-") as tmp:
        a = build_engine(p.spec(False))
        blocks_a = a.engine.blocks.num_blocks
        log(f"engine A (LoRA disabled) built in {a.build_s:.1f} s; "
            f"graphs {'on' if a.engine.runner.graphs else 'off'}; {blocks_a} KV blocks")
        b = build_engine(p.spec(True, num_kv_blocks=blocks_a), Path(tmp) / "adapters")
        log(f"engine B (LoRA enabled, {len(b.adapters)} rank-{p.lora_rank} adapters, "
            f"max_loras {p.max_loras}) built in {b.build_s:.1f} s; "
            f"{b.engine.blocks.num_blocks} KV blocks (forced to A's)")
        kv_blocks = {"A": blocks_a, "B": b.engine.blocks.num_blocks}
        if a.weights == "random":
            log(RANDOM_BANNER.format(model=p.model))
        engines = {"A": a.engine, "B": b.engine}
        have_graphs = a.engine.runner.graphs is not None and b.engine.runner.graphs is not None
        scs = scenarios(p, have_graphs)
        vocab = a.engine.model.config.vocab_size
        prompts = random_prompts(p.batch_size, p.input_len, vocab, p.seed)
        names = sorted(b.adapters)
        reqs = {sc.name: make_requests(prompts, p.output_len,
                                       round_robin(names[: sc.active], p.batch_size))
                for sc in scs}
        lat: dict[str, list[float]] = {sc.name: [] for sc in scs}
        counts: dict[str, list[tuple[int, int]]] = {sc.name: [] for sc in scs}
        result = {"benchmark": "lora_matrix", **environment(a.engine.device, command),
                  "weights": a.weights, "model": p.model, "params": asdict(p),
                  "engines": {"A": asdict(p.spec(False)),
                              "B": asdict(p.spec(True, num_kv_blocks=blocks_a))},
                  "kv_blocks": {**kv_blocks, "policy": "B forced to A's block count" if
                                p.num_kv_blocks is None else "both set by --num-kv-blocks"},
                  "adapters": {"count": len(names), "rank": p.lora_rank,
                               "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                           "up_proj", "down_proj"]},
                  "graphs": {"A": graph_stats(a.engine), "B": graph_stats(b.engine)},
                  "scenarios": {}, "rounds": []}
        gc.collect()
        rounds = max(sc.iters for sc in scs)
        t_start = time.perf_counter()
        for r in range(-p.num_iters_warmup, rounds):
            warm = r < 0
            todo = [sc for sc in scs if warm or r < sc.iters]
            shift = (r + p.num_iters_warmup) % len(todo)
            order = todo[shift:] + todo[:shift]
            for sc in order:
                dt, pre, rec = _run_one(engines[sc.engine], sc, reqs[sc.name],
                                        check_len=p.output_len if r == -p.num_iters_warmup else None)
                if not warm:
                    lat[sc.name].append(dt)
                    counts[sc.name].append((pre, rec))
            if not warm:
                result["rounds"].append([sc.name for sc in order])
                result["scenarios"] = _summaries(scs, lat, p.output_len, counts, kv_blocks)
                write_json(p.output_json, result)  # partial results survive a kill
            log(f"round {r + 1 if not warm else 'warmup'}/{rounds}: " + ", ".join(
                f"{sc.name} {lat[sc.name][-1]:.3f}s" if not warm else sc.name for sc in order)
                + f"  [{time.perf_counter() - t_start:.0f} s]")
        result["scenarios"] = _summaries(scs, lat, p.output_len, counts, kv_blocks)
        result["memory"] = {"A": memory_stats(a.engine, a), "B": memory_stats(b.engine, b)}
        ma, mb = result["memory"]["A"], result["memory"]["B"]
        if "other_allocated_bytes" in ma and "other_allocated_bytes" in mb:
            result["memory"]["lora_measured_extra_bytes"] = \
                mb["other_allocated_bytes"] - ma["other_allocated_bytes"]
        result["summary"] = _targets(result, have_graphs, p.max_loras)
        if p.profile_kernels:
            result["profile_kernels"] = compare_decode_kernels(a.engine, b.engine, prompts)
    write_json(p.output_json, result)
    return result


def _summaries(scs: list[Scenario], lat: dict[str, list[float]], output_len: int,
               counts: dict[str, list[tuple[int, int]]] | None = None,
               kv_blocks: dict[str, int] | None = None) -> dict:
    out = {}
    for sc in scs:
        xs = lat[sc.name]
        if not xs:
            continue
        avg = sum(xs) / len(xs)
        cs = (counts or {}).get(sc.name)
        out[sc.name] = {"engine": sc.engine, "graphs": sc.graphs, "active_adapters": sc.active,
                        "baseline": sc.base, "n": len(xs), "avg": avg,
                        "kv_blocks": (kv_blocks or {}).get(sc.engine),
                        "preemptions": sum(c[0] for c in cs) if cs else None,
                        "recomputed_tokens": sum(c[1] for c in cs) if cs else None,
                        "p50": percentile(xs, 50), "p90": percentile(xs, 90),
                        "min": min(xs), "ms_per_token_incl_prefill": avg / output_len * 1e3,
                        "latencies": xs}
    for s in out.values():
        base = out.get(s["baseline"])
        if base:
            s["ratio_avg"] = s["avg"] / base["avg"]
            s["ratio_p50"] = s["p50"] / base["p50"]
            s["slowdown_pct_avg"] = (s["ratio_avg"] - 1) * 100
            s["slowdown_pct_p50"] = (s["ratio_p50"] - 1) * 100
    _add_paired_to_scenarios(out)
    if kv_blocks is not None:
        comparable.apply(out, kv_blocks)
    return out


def _add_paired_to_scenarios(scenarios: dict) -> None:
    # each scenario against its baseline, where both ran in the same rounds
    for s in scenarios.values():
        base = scenarios.get(s["baseline"])
        if base is not None and base is not s and len(base["latencies"]) == len(s["latencies"]):
            s.update(paired_slowdown(base["latencies"], s["latencies"]))


def _paired_fields(scenario: dict) -> dict:
    return {k: scenario.get(k) for k in ("paired_slowdown_pct_median", "paired_slowdown_pct_ci95")}


def add_paired(result: dict) -> dict:
    """Recompute the paired statistics of a saved matrix JSON (files written before they
    existed) in place, from its per-round latencies; returns it."""
    sc = result["scenarios"]
    _add_paired_to_scenarios(sc)
    for name, t in result.get("summary", {}).items():
        if name in sc and "target_pct" in t:
            t.update(_paired_fields(sc[name]))
    return result


def paired_slowdown(base: list[float], xs: list[float], n_boot: int = 2000) -> dict:
    """Scenario vs baseline per timed round (each round runs both, so pairing cancels drift
    between rounds): median of xs[i] / base[i] - 1 in %, with a 95 % bootstrap interval of
    that median (fixed seed: the same JSON gives the same numbers)."""
    import random
    rel = sorted((x / b - 1) * 100 for b, x in zip(base, xs))
    rng = random.Random(0)
    boots = sorted(percentile(rng.choices(rel, k=len(rel)), 50) for _ in range(n_boot))
    return {"paired_slowdown_pct_median": percentile(rel, 50),
            "paired_slowdown_pct_ci95": [percentile(boots, 2.5), percentile(boots, 97.5)]}


def _targets(result: dict, have_graphs: bool, max_loras: int) -> dict:
    """The issue's numbers against its targets (graph scenarios; eager is for comparison)."""
    sc, out = result["scenarios"], {}
    for name, key in (("lora_enabled_0_active", "lora_enabled_0_active"),
                      ("lora_1_active", "lora_1_active"),
                      (f"lora_{max_loras}_active", "many_active")):
        if name in sc and "slowdown_pct_p50" in sc[name]:
            v = sc[name]["slowdown_pct_p50"]
            ok = sc[name].get("comparable", True)
            out[name] = {"slowdown_pct_p50": v, "slowdown_pct_avg": sc[name]["slowdown_pct_avg"],
                         **_paired_fields(sc[name]),
                         "graphs": sc[name]["graphs"], "target_pct": TARGETS[key],
                         "comparable": ok,
                         "not_comparable_reasons": sc[name].get("not_comparable_reasons", []),
                         "met": v <= TARGETS[key] if ok else None}
    ga, gb = result["graphs"]["A"], result["graphs"]["B"]
    if have_graphs and ga.get("enabled") and gb.get("enabled"):
        alone = ga["pool_bytes"].get("no_lora") or 0
        both = sum(gb["pool_bytes"].values())
        ratio = both / alone if alone > 0 else None
        out["graph_memory"] = {
            "no_lora_alone_mib (engine A)": alone / (1 << 20),
            "per_set_mib (engine B)": {k: v / (1 << 20) for k, v in gb["pool_bytes"].items()},
            "both_sets_mib (engine B)": both / (1 << 20), "ratio": ratio,
            "target": TARGETS["memory_ratio"],
            "met": None if ratio is None else ratio <= TARGETS["memory_ratio"]}
        out["capture"] = {"A_no_lora_s": ga["capture_s"], "B_both_sets_s": gb["capture_s"],
                          "target_s": TARGETS["capture_s"],
                          "met": gb["capture_s"] <= TARGETS["capture_s"]}
    return out


# ---- kernel equality check ---------------------------------------------------------------
def decode_step_kernels(engine, prompts: list[list[int]]) -> collections.Counter:
    """Kernel names launched by ONE eager decode step of a no-adapter batch.

    Graph replays hide their kernels from the profiler, so the step runs eagerly; a no-LoRA
    graph is captured from exactly this code path. On CPU the aten ops stand in for kernels.
    """
    return collections.Counter(name for name, _ in decode_step_profile(engine, prompts))


@contextlib.contextmanager
def probe_scheduler(engine, prompts: list[list[int]], adapters: list[str | None] | None = None):
    """A scheduler of its own holding one request per prompt (row i runs adapters[i], None =
    base), for stepping the engine by hand; rows still running on exit are finished, which
    gives back their KV blocks and LoRA pins."""
    from batchrun.engine.config import SamplingParams
    from batchrun.engine.scheduler import Scheduler
    from batchrun.engine.sequence import Sequence
    sched = Scheduler(engine.config, engine.blocks, engine.lora)
    for i, ids in enumerate(prompts):
        sched.add(Sequence(i, f"probe{i}", ids, SamplingParams(max_tokens=4, ignore_eos=True),
                           adapters[i] if adapters else None, None))
    try:
        yield sched
    finally:
        for seq in list(sched.running):
            sched.finish(seq, "length")


@contextlib.contextmanager
def decoding_batch(engine, prompts: list[list[int]], adapters: list[str | None] | None = None,
                   graphs: bool = False):
    """Prefill `prompts` (row i runs adapters[i], None = base) and yield (runner, seqs): a batch
    whose next runner.decode(seqs) is one decode step. The step may be repeated (it rewrites the
    same KV slot). Graphs are off unless graphs=True; KV blocks are given back afterwards."""
    with eager(engine, on=not graphs), probe_scheduler(engine, prompts, adapters) as sched:
        while sched.waiting or any(s.needs_prefill for s in sched.running):
            engine.step(sched)  # prefill (maybe in chunks) until every row is decoding
        batch = sched.schedule()
        assert not batch.is_prefill and len(batch.seqs) == len(prompts)
        yield engine.runner, batch.seqs


def decode_step_profile(engine, prompts: list[list[int]],
                        adapters: list[str | None] | None = None) -> list[tuple[str, float]]:
    """(kernel name, device µs) of every kernel of ONE eager decode step; row i runs
    adapters[i] (None = base). CPU: aten ops and their CPU time."""
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.device.type == "cuda"
    with decoding_batch(engine, prompts, adapters) as (runner, seqs):
        runner.decode(seqs)  # one untimed step: allocator, lazy inits
        sync(engine)
        acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            runner.decode(seqs)
            sync(engine)
    if cuda:
        return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]
    return [(e.name, e.cpu_time) for e in prof.events() if e.name.startswith("aten::")]


def compare_decode_kernels(engine_a, engine_b, prompts) -> dict:
    ka = decode_step_kernels(engine_a, prompts)
    kb = decode_step_kernels(engine_b, prompts)

    def split(c):  # copies/fills are the step's input writes, compared separately
        core = collections.Counter({k: v for k, v in c.items()
                                    if "Memcpy" not in k and "Memset" not in k})
        return core, c - core
    core_a, copies_a = split(ka)
    core_b, copies_b = split(kb)
    extra, missing = core_b - core_a, core_a - core_b
    return {"device": engine_a.device.type, "kind": "cuda kernels" if engine_a.device.type ==
            "cuda" else "aten ops (cpu)",
            "passed": not extra and not missing and sum(core_a.values()) > 0,
            "num_kernels_A": sum(core_a.values()), "num_kernels_B": sum(core_b.values()),
            "extra_in_B": dict(extra), "missing_in_B": dict(missing),
            "copies_A": dict(copies_a), "copies_B": dict(copies_b),
            "kernels_A": dict(ka)}


# ---- report ------------------------------------------------------------------------------
def print_matrix(r: dict, echo=print) -> None:
    if r["weights"] == "random":
        echo(RANDOM_BANNER.format(model=r["model"]))
    p = r["params"]
    echo(f"model {r['model']} ({r['weights']} weights), device {r['device']}, commit "
         f"{r['commit'][:12]}{' (dirty)' if r.get('git_dirty') else ''}; batch {p['batch_size']}, "
         f"input {p['input_len']}, output {p['output_len']}; adapters: {r['adapters']['count']} "
         f"x rank {r['adapters']['rank']} on q,k,v,o,gate,up,down"
         + (f"; preset {p['preset']}" if p.get("preset") else ""))
    kv = r.get("kv_blocks")
    if kv:
        echo(f"KV cache: engine A {kv['A']} blocks, engine B {kv['B']} blocks ({kv['policy']})")
    mem = r.get("memory", {})
    if "B" in mem:
        echo(format_lora_memory(mem["B"].get("lora_breakdown_bytes"),
                                mem.get("lora_measured_extra_bytes")))
    pk = r.get("profile_kernels")
    if pk:
        verdict = "PASS" if pk["passed"] else "FAIL"
        echo(f"kernel check ({pk['kind']}, one eager no-adapter decode step, LoRA engine vs "
             f"LoRA-disabled engine): {verdict} ({pk['num_kernels_B']} vs {pk['num_kernels_A']})")
        if not pk["passed"]:
            echo(f"  extra in LoRA engine: {pk['extra_in_B']}")
            echo(f"  missing in LoRA engine: {pk['missing_in_B']}")
        if pk["copies_A"] != pk["copies_B"]:
            echo(f"  (copies differ: A {pk['copies_A']} / B {pk['copies_B']})")
    s = r.get("summary", {})
    for key in ("graph_memory", "capture"):
        if key in s:
            m = s[key]
            if key == "graph_memory":
                per = ", ".join(f"{k} {v:.1f}" for k, v in m["per_set_mib (engine B)"].items())
                ratio = "n/a" if m["ratio"] is None else f"{m['ratio']:.3f}x"
                echo(f"graph pool memory: LoRA engine per set [{per}] MiB = "
                     f"{m['both_sets_mib (engine B)']:.1f} MiB vs no-LoRA set alone "
                     f"{m['no_lora_alone_mib (engine A)']:.1f} MiB -> {ratio} "
                     f"(target <= {m['target']}x: {_met(m['met'])})")
            else:
                echo(f"graph capture: LoRA engine both sets {m['B_both_sets_s']:.2f} s, "
                     f"LoRA-disabled engine {m['A_no_lora_s']:.2f} s (target <= "
                     f"{m['target_s']:.0f} s: {_met(m['met'])})")
    echo("")
    head = f"{'scenario':<28}{'n':>4}{'avg s':>10}{'p50 s':>10}{'p90 s':>10}{'ms/tok':>9}" \
           f"{'vs base p50':>13}{'vs base avg':>13}{'paired [95% CI]':>28}{'preempt':>9}" \
           f"{'recomp tok':>11}  target (p50)"
    echo(head)
    echo("-" * len(head))
    for name, sc in r["scenarios"].items():
        tgt = s.get(name)
        target = f"<= {tgt['target_pct']}%: {_met(tgt['met'])}" if tgt else ""
        if sc.get("comparable") is False:
            target = "NOT COMPARABLE (see below)"
        rel_p50 = f"{sc['slowdown_pct_p50']:+.2f}%" if "slowdown_pct_p50" in sc else ""
        rel_avg = f"{sc['slowdown_pct_avg']:+.2f}%" if "slowdown_pct_avg" in sc else ""
        paired = ""
        if "paired_slowdown_pct_median" in sc:
            lo, hi = sc["paired_slowdown_pct_ci95"]
            paired = f"{sc['paired_slowdown_pct_median']:+.2f}% [{lo:+.2f}, {hi:+.2f}]"
        if name == sc["baseline"]:
            rel_p50, rel_avg, paired = "(base)", "(base)", "(base)"
        echo(f"{name:<28}{sc['n']:>4}{sc['avg']:>10.4f}{sc['p50']:>10.4f}{sc['p90']:>10.4f}"
             f"{sc['ms_per_token_incl_prefill']:>9.3f}{rel_p50:>13}{rel_avg:>13}{paired:>28}"
             f"{_fmt_count(sc.get('preemptions')):>9}{_fmt_count(sc.get('recomputed_tokens')):>11}"
             f"  {target}")
    for name, sc in r["scenarios"].items():
        if sc.get("comparable") is False:
            echo(f"NOT COMPARABLE: {name} vs {sc['baseline']}: "
                 + "; ".join(sc["not_comparable_reasons"]) + " (no target verdict)")


def _fmt_count(v) -> str:
    return "n/a" if v is None else str(v)


def _met(v) -> str:
    return "n/a" if v is None else ("met" if v else "MISSED")
