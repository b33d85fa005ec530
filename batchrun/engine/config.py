"""Engine and sampling configuration (dataclasses, validated on construction)."""
from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from batchrun.engine.envs import Experiments, env_name
from batchrun.errors import ConfigError
from batchrun.common.short_repr import short_repr


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-row seed: same seed -> same tokens, whatever the batch-mates
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: fixed output length
    stop: tuple[str, ...] = ()  # stop strings (need a tokenizer): text ends before the first match
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # EOS / stop_token_ids / stop strings do not end the output before this
    presence_penalty: float = 0.0  # vLLM semantics: over output tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens (HF / vLLM)
    logprobs: int | None = None  # k: each generated token's logprob plus the top k
    response_format: str | None = None  # canonical JSON (job.response_format_json): a token mask per step

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# ---- the engine ---------------------------------------------------------------------------------
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# EngineConfig fields a job file does not set in its engine: section: the job's model path,
# whether it has adapters (enable_lora) and sampling.seed (seed) decide them, and the experiment
# switches come from BATCHRUN_* environment variables (engine/envs.py).
JOB_DERIVED_FIELDS = ("model", "enable_lora", "seed", "experiments")
# engine: keys that became experiment switches (old key -> Experiments field): a job file, an
# LLM(**engine) call or a bench flag that still sets one is refused with the variable to set
REMOVED_ENGINE_KEYS = {"async_scheduling": "async_scheduling", "enable_mixed_steps": "mixed_steps",
                       "triton_decode_gemm": "triton_decode_gemm",
                       "prefill_graph_max_tokens": "prefill_graph_max_tokens",
                       "lora_fused_max_tokens": "lora_fused_max_tokens",
                       "num_kv_blocks": "num_kv_blocks"}
# engine: keys that became a kernel's variable, read when kernels/ imports (envs.py lists them)
_KERNEL_VARIABLES = {"pdl": "BATCHRUN_PDL"}

def dtype_name(name: str, config_dtype: str | None, device_type: str) -> str:
    """engine.dtype resolved to a dtype name: auto -> float32 on the CPU, else the checkpoint's
    torch_dtype (bfloat16 when it names none). The loader turns it into a torch dtype; the job
    side records it (torch-free) so a resume on another kind of node is caught."""
    if name != "auto":
        return name
    if device_type == "cpu":
        return "float32"
    return config_dtype or "bfloat16"


def context_max_model_len(max_model_len: int | str, mcfg) -> int:
    """engine.max_model_len as far as config.json decides it (torch-free: the job side's checks,
    `plan`, the fingerprint): an integer as given, auto -> the model's context (config.json
    max_position_embeddings; ``mcfg``: a ModelConfig). The engine may lower auto further when it
    starts (kv_sizing.resolve_max_model_len)."""
    return mcfg.max_position_embeddings if max_model_len == "auto" else max_model_len


# max_num_seqs "auto": at most this many (engine/kv_sizing.py says why; fewer when the KV cache
# holds fewer max_model_len sequences)
AUTO_MAX_NUM_SEQS = {"cuda": 256, "cpu": 16}


@dataclass
class EngineConfig:
    """How the engine is built and run: the one list of engine settings. job.yaml's ``engine:``
    section, ``batchrun.LLM(**engine)`` and the bench flags all build this, and it checks its
    values itself (``__post_init__``), with job-file field paths (``engine.max_num_seqs: ...``)."""
    model: str
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (config torch_dtype on GPU, float32 on CPU) | float32 | float16 | bfloat16
    # fp8: quantize an unquantized checkpoint's linear layers to FP8 at load time
    # (models/quant.py); None: the checkpoint's own format (an FP8 checkpoint runs in FP8 either way)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8 (e4m3, scaled)
    max_num_seqs: int | str = 64  # "auto": sized from the KV cache when the engine starts (kv_sizing.py)
    # "auto": the model's context (config.json max_position_embeddings), lowered when the engine
    # starts to what its KV cache holds for one sequence
    max_model_len: int | str = "auto"
    max_loras: int = 4  # GPU slots
    max_lora_rank: int = 64
    enforce_eager: bool = False
    max_num_batched_tokens: int = 2048  # per step; long prompts are prefilled in chunks of this size
    gpu_memory_utilization: float = 0.90
    block_size: int = 16
    cpu_kv_cache_gb: float = 1.0  # fixed KV budget on CPU
    enable_lora: bool = False
    max_cpu_loras: int | None = None  # LRU CPU cache size; None = keep all loaded adapters
    # full KV blocks are shared by rows whose prompts start with the same tokens (same adapter);
    # outputs are the same either way, only the prefill work differs
    enable_prefix_caching: bool = True
    cuda_graph_sizes: list[int] | None = None  # None = 1, 2, 4, 8, 16, 24, ... up to max_num_seqs
    seed: int = 0
    # A/B switches, not user settings: BATCHRUN_* environment variables (engine/envs.py)
    experiments: Experiments = field(default_factory=Experiments.from_env)

    def __post_init__(self):
        for name, message in engine_problems(self):
            raise ConfigError(f"engine.{name}: {message}")


# the smallest value of each integer field (a larger minimum than 1 or 0 has its own check)
_ENGINE_MIN = {"max_num_seqs": 1, "max_model_len": 1, "max_loras": 1, "max_lora_rank": 1,
               "max_num_batched_tokens": 1, "block_size": 1, "max_cpu_loras": 1, "seed": 0}
QUANTIZATIONS = ("fp8",)
KV_CACHE_DTYPES = ("auto", "fp8")
_ENGINE_CHOICES = {"device": DEVICES, "dtype": DTYPES, "quantization": QUANTIZATIONS,
                   "kv_cache_dtype": KV_CACHE_DTYPES}
TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
              dict: "a mapping", list: "a list", object: "a value"}


def removed_key_message(key: str, value: Any = None) -> str | None:
    """Why engine key `key` is refused and what replaces it, or None when it is not a removed key.
    `value` (what the caller set) is shown as the variable's value when it is one."""
    if key in _KERNEL_VARIABLES:
        var = _KERNEL_VARIABLES[key]
    elif key in REMOVED_ENGINE_KEYS:
        var = env_name(REMOVED_ENGINE_KEYS[key])
    else:
        return None
    if isinstance(value, bool):
        shown = "1" if value else "0"
    elif isinstance(value, int) or value is None:
        shown = "none" if value is None else str(value)
    else:
        shown = "..."
    return (f"{key} was removed: it is an experiment switch now, set {var}={shown} in the "
            "environment (batchrun/engine/envs.py)")


def type_ok(value: Any, typ: type) -> bool:
    """YAML/JSON typing: bool is not an integer, an integer is a number."""
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, typ)


def finite_float(value: int | float) -> float | None:
    """A YAML/JSON number as a float, None when it is not finite (nan, inf, an integer too
    large for a float): job-file fields and EngineConfig refuse those alike."""
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def show(value: Any) -> str:
    return f"{short_repr(value)} ({type(value).__name__})"


@functools.cache
def engine_field_types() -> dict[str, tuple[type, bool]]:
    """{field: (type, nullable)} from EngineConfig's annotations (list[int] -> list)."""
    out = {}
    for name, hint in typing.get_type_hints(EngineConfig).items():
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        base = [a for a in args if a is not type(None)][0]
        out[name] = (typing.get_origin(base) or base, type(None) in args)
    return out


def job_engine_fields() -> tuple[str, ...]:
    """The keys a job file's engine: section may have, in EngineConfig's order."""
    return tuple(f.name for f in fields(EngineConfig) if f.name not in JOB_DERIVED_FIELDS)


def engine_problems(cfg: EngineConfig):
    """(field, message) for each bad EngineConfig value; integers given for number fields become
    floats on the way (so asdict() and the fingerprint see one type)."""
    for name, (typ, nullable) in engine_field_types().items():
        v = getattr(cfg, name)
        if v is None and nullable:
            continue
        if name == "max_num_seqs" and v == "auto":
            continue  # resolved from the KV cache when the engine starts (kv_sizing.py)
        if name == "max_model_len" and v == "auto":
            continue  # the model's context, lowered to the KV cache when the engine starts (kv_sizing.py)
        if name == "max_model_len" and not type_ok(v, int):
            yield name, (f"expected an integer, got {show(v)}; or auto (the model's context, lowered "
                         "to what the KV cache holds for one sequence when the engine starts)")
            return
        if name == "max_num_seqs" and not type_ok(v, int):
            yield name, (f"expected an integer, got {show(v)}; or auto (as many sequences as the KV "
                         "cache holds at max_model_len, up to 256 on a GPU and 16 on CPU)")
            return
        if not type_ok(v, typ):
            expected = TYPE_NAMES.get(typ, f"a {typ.__name__}")
            yield name, f"expected {expected}{' or null' if nullable else ''}, got {show(v)}"
            return
        if typ is float:
            number = finite_float(v)
            if number is None:
                yield name, f"must be a finite number, got {show(v)}"
                return
            setattr(cfg, name, number)
        if name in _ENGINE_CHOICES and v not in _ENGINE_CHOICES[name]:
            yield name, f"expected one of {', '.join(_ENGINE_CHOICES[name])}, got {short_repr(v)}"
            return
        if name in _ENGINE_MIN and v < _ENGINE_MIN[name]:
            yield name, f"must be >= {_ENGINE_MIN[name]}, got {v}"
            return
    if not 0 < cfg.gpu_memory_utilization <= 1:
        yield "gpu_memory_utilization", f"must be in (0, 1], got {cfg.gpu_memory_utilization}"
    if not cfg.cpu_kv_cache_gb > 0:
        yield "cpu_kv_cache_gb", f"must be > 0, got {cfg.cpu_kv_cache_gb}"
    sizes = cfg.cuda_graph_sizes
    if sizes is not None and not all(type_ok(s, int) and s >= 1 for s in sizes):
        yield "cuda_graph_sizes", f"expected a list of batch sizes (integers >= 1) or null, got {short_repr(sizes)}"
