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
flagged not comparable (comparable.py) and gets no target verdict. The table is printed by
matrix_report.py.

Each runs with CUDA graphs and eagerly (timing.eager() for that iteration). Every round runs
one iteration of each scenario, in an order rotated by one per round, so slow drift (clocks,
temperature) spreads over all scenarios instead of biasing the ones measured last.
"""
from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from batchrun.bench.build import build_engine, make_requests, random_prompts, round_robin
from batchrun.bench.engine_stats import graph_stats, memory_stats
from batchrun.bench.flags import engine_config
from batchrun.bench.kernel_check import compare_decode_kernels
from batchrun.bench.latency import RANDOM_BANNER
from batchrun.bench.matrix_stats import DEFAULT_TARGETS, _summaries, _targets
from batchrun.bench.record import environment, write_json
from batchrun.bench.timing import eager, time_generate
from batchrun.engine.config import EngineConfig
from batchrun.engine.envs import Experiments

# --preset: vLLM's latency workload, and the offline-job batch of issue #16 with its budget for
# many adapters (10 %; the latency workload keeps 15 %)
PRESETS = {"latency": dict(batch_size=8, input_len=32, output_len=128, max_num_seqs=None,
                           max_num_batched_tokens=2048),
           "throughput": dict(batch_size=256, input_len=256, output_len=128, max_num_seqs=256,
                              max_num_batched_tokens=8192, target_many_active_pct=10.0)}


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
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_loras: int = 8
    max_lora_rank: int = 16
    lora_rank: int = 16
    enforce_eager: bool = False
    no_eager: bool = False
    profile_kernels: bool = False
    seed: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    # both engines' KV blocks (Experiments.num_kv_blocks); None: A sized from free memory, B = A's
    num_kv_blocks: int | None = None
    preset: str | None = None  # recorded; the CLI applies it (apply_preset)
    target_0_active_pct: float = DEFAULT_TARGETS["lora_enabled_0_active"]
    target_1_active_pct: float = DEFAULT_TARGETS["lora_1_active"]
    target_many_active_pct: float = DEFAULT_TARGETS["many_active"]
    target_memory_ratio: float = DEFAULT_TARGETS["memory_ratio"]
    target_capture_s: float = DEFAULT_TARGETS["capture_s"]
    output_json: str | None = None

    @property
    def targets(self) -> dict:
        return {"lora_enabled_0_active": self.target_0_active_pct, "lora_1_active": self.target_1_active_pct,
                "many_active": self.target_many_active_pct, "memory_ratio": self.target_memory_ratio,
                "capture_s": self.target_capture_s}

    def check(self) -> None:
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"--num-kv-blocks must be >= 2, got {self.num_kv_blocks}")
        for name in ("batch_size", "input_len", "output_len", "num_iters", "max_loras", "lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_iters_warmup < 0 or (self.num_iters_eager is not None and self.num_iters_eager < 0):
            raise ValueError("--num-iters-warmup and --num-iters-eager must be >= 0")
        if self.lora_rank > self.max_lora_rank:
            raise ValueError(f"--lora-rank {self.lora_rank} is above --max-lora-rank {self.max_lora_rank}")
        if self.enforce_eager and self.no_eager:
            raise ValueError("--enforce-eager and --no-eager together leave nothing to run")
        self.engine_config(True)  # the engine flags' own checks (EngineConfig's, named by flag)

    def engine_config(self, enable_lora: bool, num_kv_blocks: int | None = None) -> EngineConfig:
        # the environment's experiment switches, with the KV block count both engines share
        experiments = replace(Experiments.from_env(),
                              num_kv_blocks=num_kv_blocks or self.num_kv_blocks)
        return engine_config(model=self.model, device=self.device, dtype=self.dtype, seed=self.seed,
                             quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
                             enable_lora=enable_lora, max_loras=self.max_loras,
                             max_lora_rank=self.max_lora_rank, enforce_eager=self.enforce_eager,
                             experiments=experiments,
                             max_num_seqs=self.max_num_seqs if self.max_num_seqs is not None else max(64, self.batch_size),
                             max_model_len=self.input_len + self.output_len,
                             max_num_batched_tokens=self.max_num_batched_tokens,
                             # every iteration repeats the same prompts: a prefix cache would skip their prefill
                             # after the first and make the figures incomparable with a cold engine's
                             enable_prefix_caching=False)

    def engine_record(self, enable_lora: bool, num_kv_blocks: int | None = None) -> dict:
        """An engine's settings as the result JSON records them."""
        return {**asdict(self.engine_config(enable_lora, num_kv_blocks)),
                "lora_rank": self.lora_rank, "num_adapters": self.max_loras if enable_lora else 0}


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
        a = build_engine(p.engine_config(False))
        blocks_a = a.engine.blocks.num_blocks
        log(f"engine A (LoRA disabled) built in {a.build_s:.1f} s; "
            f"graphs {'on' if a.engine.runner.graphs else 'off'}; {blocks_a} KV blocks")
        b = build_engine(p.engine_config(True, num_kv_blocks=blocks_a), p.max_loras, p.lora_rank,
                         Path(tmp) / "adapters")
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
                  "engines": {"A": p.engine_record(False),
                              "B": p.engine_record(True, num_kv_blocks=blocks_a)},
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
        result["summary"] = _targets(result, have_graphs, p.max_loras, p.targets)
        if p.profile_kernels:
            result["profile_kernels"] = compare_decode_kernels(a.engine, b.engine, prompts)
    write_json(p.output_json, result)
    return result
