"""`batchrun bench latency`: the latency of one batch, end to end, like `vllm bench latency`.

Each iteration is one `engine.generate` of `batch_size` requests with random token prompts and
a fixed output length (ignore_eos), timed with perf_counter between two device syncs. Also used
by matrix.py: engine building, the environment record, percentiles and timing live here.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine, max_position, resolve_device
from batchrun.engine.request import Request
from batchrun.errors import ConfigError
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.models.loader import random_model, resolve_dtype
from batchrun.bench.adapters import write_random_adapters
from batchrun.bench.lora_memory import format_lora_memory, lora_memory
from batchrun.bench.presets import PRESETS, is_preset, preset_config

PERCENTILES = (10, 25, 50, 75, 90, 99)
MIB = 1 << 20
GIB = 1 << 30
RANDOM_BANNER = ("*** RANDOM WEIGHTS: {model}-shaped model, weights ~ N(0, 0.02) (nothing can be "
                 "downloaded here); the timings are real, the generated tokens are noise ***")


# ---- setup ------------------------------------------------------------------------------
@dataclass
class EngineSpec:
    """What to build: everything that decides the engine and its model."""
    model: str  # preset name (random weights) or a local HF model directory
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_rank: int = 16  # rank of the random adapters
    num_adapters: int = 0  # random adapters written and loaded (engine has LoRA hooks only if > 0)
    enforce_eager: bool = False
    max_num_seqs: int = 64
    max_model_len: int = 160
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None  # None: sized from free memory (kv_sizing.py)


@dataclass
class Built:
    engine: Engine
    weights: str  # "random" | "checkpoint"
    adapters: dict[str, str] = field(default_factory=dict)
    build_s: float = 0.0
    allocated_bytes: int | None = None  # CUDA: memory_allocated after - before building


def model_config_of(model: str) -> ModelConfig:
    if is_preset(model):
        return preset_config(model)
    if not Path(model).is_dir():
        raise ConfigError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor "
                          f"a local Hugging Face model directory")
    return ModelConfig.from_dir(model)


def build_engine(spec: EngineSpec, adapter_root: str | Path | None = None) -> Built:
    """A preset name builds random weights on the device; anything else is a model directory.
    With LoRA, `num_adapters` random rank-`lora_rank` adapters are written under adapter_root
    and loaded through the engine's normal adapter path."""
    t0 = time.perf_counter()
    torch.manual_seed(spec.seed)
    mcfg = model_config_of(spec.model)
    device = resolve_device(spec.device)
    before = _allocated(device)
    adapters: dict[str, str] = {}
    if spec.enable_lora and spec.num_adapters > 0:
        if adapter_root is None:
            raise ValueError("adapter_root is needed to write the random adapters")
        adapters = write_random_adapters(adapter_root, mcfg, spec.num_adapters, spec.lora_rank,
                                         seed=spec.seed, base_model=spec.model)
    config = EngineConfig(model=spec.model, device=spec.device, dtype=spec.dtype,
                          max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                          max_num_batched_tokens=spec.max_num_batched_tokens,
                          enable_lora=spec.enable_lora, max_loras=spec.max_loras,
                          max_lora_rank=spec.max_lora_rank, enforce_eager=spec.enforce_eager,
                          seed=spec.seed, num_kv_blocks=spec.num_kv_blocks)
    try:
        if is_preset(spec.model):
            dtype = resolve_dtype(spec.dtype, mcfg, device)
            model = random_model(mcfg, device, dtype, max_position(config, mcfg), seed=spec.seed)
            engine = Engine.from_model(config, model, None, adapters or None)
            weights = "random"
        else:
            engine = Engine.from_config(config, adapters or None)
            weights = "checkpoint"
    except torch.OutOfMemoryError as e:
        if spec.num_kv_blocks is None:
            raise
        raise ConfigError(f"out of device memory building an engine with num_kv_blocks="
                          f"{spec.num_kv_blocks} (the KV budget forced to match the other "
                          f"engine); lower --max-num-seqs or --num-kv-blocks ({e})") from None
    sync(engine)
    after = _allocated(device)
    return Built(engine, weights, adapters, time.perf_counter() - t0,
                 None if before is None else after - before)


def _allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def random_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Token ids in [100, vocab): clear of the special tokens at the bottom of real vocabularies."""
    if vocab <= 100:
        raise ValueError(f"vocabulary of {vocab} tokens is too small for random prompts in [100, vocab)")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, input_len), generator=g).tolist()


def make_requests(prompts: list[list[int]], output_len: int,
                  adapters: list[str | None] | None = None, tag: str = "") -> list[Request]:
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
    adapters = adapters or [None] * len(prompts)
    return [Request(f"{tag}{i}", p, sp, a) for i, (p, a) in enumerate(zip(prompts, adapters))]


def round_robin(names: list[str], rows: int) -> list[str | None]:
    """Row i gets names[i % len(names)]; no names = every row runs the base model."""
    return [names[i % len(names)] if names else None for i in range(rows)]


# ---- timing -----------------------------------------------------------------------------
@contextlib.contextmanager
def eager(engine: Engine, on: bool = True):
    """Run `engine`'s decode steps without CUDA graphs inside the block (on=False: unchanged).
    The one place the bench switches graphs off (ModelRunner.eager)."""
    with engine.runner.eager() if on else contextlib.nullcontext():
        yield


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def time_generate(engine: Engine, requests: list[Request], check_len: int | None = None) -> float:
    """Seconds for one engine.generate of the whole batch, between two device syncs."""
    sync(engine)
    t0 = time.perf_counter()
    results = engine.generate(requests)
    sync(engine)
    dt = time.perf_counter() - t0
    if check_len is not None:
        for r in results:
            if r.finish_reason == "error" or r.output_tokens != check_len:
                raise RuntimeError(f"request {r.request_id}: {r.finish_reason} after "
                                   f"{r.output_tokens} tokens ({r.error}); expected {check_len}")
    return dt


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(latencies: list[float]) -> dict:
    return {"avg": sum(latencies) / len(latencies),
            "percentiles": {str(p): percentile(latencies, p) for p in PERCENTILES},
            "latencies": list(latencies)}


# ---- what was measured, where -----------------------------------------------------------
def git_commit() -> tuple[str, bool | None]:
    """(HEAD, tree has uncommitted changes). Where the tree is a copy (a device machine, whose
    copy may carry a stale .git), BATCHRUN_COMMIT names the commit it was copied from and wins;
    without it and without git: "unknown"."""
    root = Path(__file__).resolve().parents[2]
    if os.environ.get("BATCHRUN_COMMIT"):
        return os.environ["BATCHRUN_COMMIT"], None
    fallback = "unknown"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return fallback, None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=30)
        return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return fallback, None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, command: str | None = None) -> dict:
    """command: the full command line (the CLI passes every flag, defaults resolved); else
    rebuilt from sys.argv."""
    commit, dirty = git_commit()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.processor() or platform.machine()})"
    return {"command": command or shlex.join(["batchrun", *sys.argv[1:]]), "argv": list(sys.argv),
            "commit": commit, "git_dirty": dirty, "device": name,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": _version("triton"), "cuda": torch.version.cuda},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def graph_stats(engine: Engine) -> dict:
    """Capture time, sizes and pool memory per graph set; {"enabled": False} when eager."""
    g = engine.runner.graphs
    if g is None:
        return {"enabled": False}
    st = dict(g.stats)
    pools = st.get("pool_bytes", {})
    return {"enabled": True, "capture_s": st.get("capture_s"), "sizes": st.get("sizes"),
            "num_graphs": st.get("num_graphs"), "pool_bytes": dict(pools),
            "pool_mib": {k: v / MIB for k, v in pools.items()}}


def memory_stats(engine: Engine, built: Built | None = None) -> dict:
    """Weights, KV cache, LoRA buffers (lora_memory.py, by category) and, on CUDA, what building
    the engine allocated beyond its weights and KV cache (`other_allocated_bytes`)."""
    seen, weights = set(), 0
    for p in engine.model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    kv = engine.runner.kv_cache
    lora = 0
    if engine.lora is not None:
        lora = sum(h.lora_a.numel() * h.lora_a.element_size() +
                   h.lora_b.numel() * h.lora_b.element_size() for h in engine.lora.hooks.values())
    kv_bytes = kv.numel() * kv.element_size()
    out = {"weights_gib": weights / GIB, "kv_cache_gib": kv_bytes / GIB,
           "kv_blocks": engine.blocks.num_blocks, "lora_slots_gib": lora / GIB,
           "lora_breakdown_bytes": lora_memory(engine)}
    if built is not None and built.allocated_bytes is not None:
        out["other_allocated_bytes"] = built.allocated_bytes - weights - kv_bytes
    if engine.device.type == "cuda":
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated(engine.device) / GIB
        out["reserved_gib"] = torch.cuda.memory_reserved(engine.device) / GIB
    return out


def write_json(path: str | Path | None, data: dict) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


# ---- the latency benchmark --------------------------------------------------------------
@dataclass
class LatencyParams:
    model: str = "llama-2-7b"
    batch_size: int = 8
    input_len: int = 32
    output_len: int = 128
    num_iters_warmup: int = 10
    num_iters: int = 30
    dtype: str = "auto"
    device: str = "auto"
    enable_lora: bool = False
    max_loras: int | None = None  # None = max(num_active_loras, 1)
    max_lora_rank: int = 16
    lora_rank: int = 16
    num_active_loras: int = 0
    enforce_eager: bool = False
    seed: int = 0
    max_num_seqs: int | None = None  # None = max(64, batch_size)
    max_num_batched_tokens: int = 2048
    output_json: str | None = None

    def check(self) -> None:
        for name in ("batch_size", "input_len", "output_len", "num_iters", "lora_rank",
                     "max_lora_rank", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_iters_warmup < 0 or self.num_active_loras < 0:
            raise ValueError("--num-iters-warmup and --num-active-loras must be >= 0")
        if self.num_active_loras and not self.enable_lora:
            raise ValueError(f"--num-active-loras {self.num_active_loras} needs --enable-lora")
        if self.enable_lora and self.lora_rank > self.max_lora_rank:
            raise ValueError(f"--lora-rank {self.lora_rank} is above --max-lora-rank "
                             f"{self.max_lora_rank}")
        if self.enable_lora and self.num_active_loras > self.loras:
            raise ValueError(f"--num-active-loras {self.num_active_loras} > --max-loras "
                             f"{self.loras}: the batch would wait for GPU slots and the benchmark "
                             f"would time adapter swapping; raise --max-loras")

    @property
    def loras(self) -> int:
        return self.max_loras if self.max_loras is not None else max(self.num_active_loras, 1)

    def engine_spec(self) -> EngineSpec:
        return EngineSpec(
            model=self.model, device=self.device, dtype=self.dtype, seed=self.seed,
            enable_lora=self.enable_lora, max_loras=self.loras, max_lora_rank=self.max_lora_rank,
            lora_rank=self.lora_rank,
            # With LoRA on, `max_loras` adapters are loaded even when fewer (or none) are active,
            # so the engine carries its LoRA hooks and buffers as in real use.
            num_adapters=self.loras if self.enable_lora else 0,
            enforce_eager=self.enforce_eager,
            max_num_seqs=self.max_num_seqs or max(64, self.batch_size),
            max_model_len=self.input_len + self.output_len,
            max_num_batched_tokens=self.max_num_batched_tokens)


def run_latency(p: LatencyParams, log=print, command: str | None = None) -> dict:
    import tempfile
    p.check()
    with tempfile.TemporaryDirectory(prefix="batchrun-bench-") as tmp:
        built = build_engine(p.engine_spec(), Path(tmp) / "adapters")
        engine = built.engine
        if built.weights == "random":
            log(RANDOM_BANNER.format(model=p.model))
        log(f"engine built in {built.build_s:.1f} s on {engine.device} ({engine.dtype}); "
            f"graphs: {'on' if engine.runner.graphs else 'off (eager)'}")
        vocab = engine.model.config.vocab_size
        prompts = random_prompts(p.batch_size, p.input_len, vocab, p.seed)
        names = sorted(built.adapters)[: p.num_active_loras]
        reqs = make_requests(prompts, p.output_len, round_robin(names, p.batch_size))
        for i in range(p.num_iters_warmup):
            time_generate(engine, reqs, check_len=p.output_len if i == 0 else None)
        if p.num_iters_warmup == 0:  # still check once that the batch runs as asked
            time_generate(engine, reqs, check_len=p.output_len)
        lat = []
        for i in range(p.num_iters):
            lat.append(time_generate(engine, reqs))
            log(f"  iter {i + 1}/{p.num_iters}: {lat[-1]:.4f} s")
        # prefill estimate: the same batch with one output token (prefill + one sample)
        one = make_requests(prompts, 1, round_robin(names, p.batch_size), tag="prefill")
        prefill = percentile([time_generate(engine, one) for _ in range(5)], 50)
        result = {"benchmark": "latency", **environment(engine.device, command),
                  "weights": built.weights, "model": p.model, "params": asdict(p),
                  "engine": asdict(p.engine_spec()),
                  "active_adapters": names, **summarize(lat),
                  "prefill_latency_s": prefill, **per_token(sum(lat) / len(lat), prefill,
                                                            p.output_len),
                  "graphs": graph_stats(engine), "memory": memory_stats(engine, built),
                  "engine_stats": dict(engine.stats)}
    write_json(p.output_json, result)
    return result


def per_token(avg: float, prefill: float, output_len: int) -> dict:
    decode = (avg - prefill) / (output_len - 1) if output_len > 1 else None
    return {"ms_per_token_incl_prefill": avg / output_len * 1e3,
            "decode_ms_per_token": None if decode is None else decode * 1e3}


def print_latency(r: dict, echo=print) -> None:
    p = r["params"]
    if r["weights"] == "random":
        echo(RANDOM_BANNER.format(model=r["model"]))
    echo(f"model {r['model']} ({r['weights']} weights), device {r['device']}, commit "
         f"{r['commit'][:12]}{' (dirty)' if r.get('git_dirty') else ''}")
    lora = (f"LoRA on: max_loras {r['engine']['max_loras']}, rank {p['lora_rank']}, "
            f"{p['num_active_loras']} active" if p["enable_lora"] else "LoRA off")
    echo(f"batch {p['batch_size']}, input {p['input_len']}, output {p['output_len']}, "
         f"{p['num_iters']} iters after {p['num_iters_warmup']} warmup; {lora}")
    echo(f"Avg latency: {r['avg']:.6f} seconds")
    for q, v in r["percentiles"].items():
        echo(f"{q}% percentile latency: {v:.6f} seconds")
    echo(f"prefill (batch, 1 output token): {r['prefill_latency_s'] * 1e3:.2f} ms; decode "
         f"~{_fmt(r['decode_ms_per_token'])} ms/token ((avg - prefill) / (output_len - 1)); "
         f"{r['ms_per_token_incl_prefill']:.3f} ms/token incl. prefill")
    g = r["graphs"]
    if g["enabled"]:
        pools = ", ".join(f"{k} {v:.1f} MiB" for k, v in g["pool_mib"].items())
        echo(f"CUDA graphs: {g['num_graphs']} captured in {g['capture_s']:.2f} s, sizes "
             f"{g['sizes']}; pool memory per set: {pools}")
    else:
        echo("CUDA graphs: off (eager)")
    m = r["memory"]
    echo(f"memory: weights {m['weights_gib']:.2f} GiB, KV cache {m['kv_cache_gib']:.2f} GiB, "
         f"LoRA slots {m['lora_slots_gib'] * 1024:.1f} MiB"
         + (f", max allocated {m['max_allocated_gib']:.2f} GiB" if "max_allocated_gib" in m else ""))
    if p["enable_lora"]:
        echo(format_lora_memory(m.get("lora_breakdown_bytes")))
    if "other_allocated_bytes" in m:
        echo(f"allocated while building the engine beyond weights and KV: "
             f"{m['other_allocated_bytes'] / MIB:.1f} MiB")


def _fmt(v, spec=".3f") -> str:
    return "n/a" if v is None else format(v, spec)
