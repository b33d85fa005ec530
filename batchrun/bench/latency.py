"""`batchrun bench latency`: the latency of one batch, end to end, like `vllm bench latency`.

Each iteration is one `engine.generate` of `batch_size` requests with random token prompts and
a fixed output length (ignore_eos), timed with perf_counter between two device syncs
(timing.py); the engine comes from the flags through one EngineConfig (build.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from batchrun.bench.build import build_engine, make_requests, random_prompts, round_robin
from batchrun.bench.flags import engine_config
from batchrun.bench.engine_stats import MIB, graph_stats, memory_stats
from batchrun.bench.lora_memory import format_lora_memory
from batchrun.bench.record import environment, write_json
from batchrun.bench.roofline import decode_roofline, format_roofline
from batchrun.bench.timing import percentile, summarize, time_generate
from batchrun.engine.config import EngineConfig

RANDOM_BANNER = ("*** RANDOM WEIGHTS: {model}-shaped model, weights ~ N(0, 0.02) (nothing can be "
                 "downloaded here); the timings are real, the generated tokens are noise ***")


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
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
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
        for name in ("batch_size", "input_len", "output_len", "num_iters", "lora_rank"):
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
        self.engine_config()  # the engine flags' own checks (EngineConfig's, named by flag)

    @property
    def loras(self) -> int:
        return self.max_loras if self.max_loras is not None else max(self.num_active_loras, 1)

    @property
    def num_adapters(self) -> int:
        # With LoRA on, `max_loras` adapters are loaded even when fewer (or none) are active,
        # so the engine carries its LoRA hooks and buffers as in real use.
        return self.loras if self.enable_lora else 0

    def engine_config(self) -> EngineConfig:
        return engine_config(
            model=self.model, device=self.device, dtype=self.dtype, seed=self.seed,
            quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
            enable_lora=self.enable_lora, max_loras=self.loras, max_lora_rank=self.max_lora_rank,
            enforce_eager=self.enforce_eager,
            max_num_seqs=self.max_num_seqs if self.max_num_seqs is not None else max(64, self.batch_size),
            max_model_len=self.input_len + self.output_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            # every iteration repeats the same prompts: a prefix cache would skip their prefill
            # after the first and make the figures incomparable with a cold engine's
            enable_prefix_caching=False)


def run_latency(p: LatencyParams, log=print, command: str | None = None) -> dict:
    import tempfile
    p.check()
    with tempfile.TemporaryDirectory(prefix="batchrun-bench-") as tmp:
        config = p.engine_config()
        built = build_engine(config, p.num_adapters, p.lora_rank, Path(tmp) / "adapters")
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
        env = environment(engine.device, command)
        tokens = per_token(sum(lat) / len(lat), prefill, p.output_len)
        result = {"benchmark": "latency", **env,
                  "weights": built.weights, "model": p.model, "params": asdict(p),
                  "engine": {**asdict(config), "num_adapters": p.num_adapters},
                  "active_adapters": names, **summarize(lat),
                  "prefill_latency_s": prefill, **tokens,
                  "graphs": graph_stats(engine), "memory": memory_stats(engine, built),
                  "decode_roofline": decode_roofline(engine, env["device"], p.batch_size, p.input_len,
                                                     p.output_len, tokens["decode_ms_per_token"]),
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
    if "decode_roofline" in r:
        echo(format_roofline(r["decode_roofline"]))
    g = r["graphs"]
    if g["enabled"]:
        pools = ", ".join(f"{k} {v:.1f} MiB" for k, v in g["pool_mib"].items())
        echo(f"CUDA graphs: {g['num_graphs']} captured in {g['capture_s']:.2f} s, sizes "
             f"{g['sizes']}; pool memory per set: {pools}")
        pg = g.get("prefill")
        echo("prefill graphs: off" if pg is None else
             f"prefill graphs: {pg['num_captures']} captures (token sizes {pg['sizes']}, LoRA "
             f"slot bounds {pg['slot_bounds']}) of {pg['pieces_per_capture']} pieces each in "
             f"{pg['capture_s']:.2f} s")
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
