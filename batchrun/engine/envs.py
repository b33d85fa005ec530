"""Experiment switches: the engine's A/B levers, read from ``BATCHRUN_*`` environment variables.

None of these is a user setting (job.yaml's ``engine:`` section holds those, engine/config.py):
each picks between two ways of computing the same outputs, or sizes a mechanism, and its
default is the one docs/benchmarks.md measured faster. They are read once, when an
``EngineConfig`` is built (``Experiments.from_env()``); tests and benchmarks pass an
``Experiments`` instead of touching the environment. A bad value is an error naming the variable.

The Triton kernels (kernels/, which import nothing from batchrun.engine) read their own switch
once, when the module is imported:

- BATCHRUN_PDL (kernels/pdl.py, default 1): the kernels launch with programmatic dependent
  launch on sm_90+ GPUs, each starting while the one before drains; same outputs bit for bit.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

from batchrun.errors import ConfigError

PREFIX = "BATCHRUN_"


@dataclass(frozen=True)
class Experiments:
    # BATCHRUN_ASYNC_SCHEDULING: the host plans and launches step n+1 while the device runs
    # step n (vLLM's async scheduling); same outputs, host time hidden behind device time
    async_scheduling: bool = True
    # BATCHRUN_MIXED_STEPS: one step carries the running rows' decode tokens and prompt chunks
    # (vLLM's unified scheduling); off: prefill and decode steps alternate
    mixed_steps: bool = False
    # BATCHRUN_TRITON_DECODE_GEMM: steps of <= 16 rows run q/k/v, gate/up and down in the
    # weight-streaming Triton GEMM (fp16/bf16 on CUDA) instead of cuBLAS; rounding differs only
    triton_decode_gemm: bool = True
    # BATCHRUN_PREFILL_GRAPH_MAX_TOKENS: prefill steps of at most this many tokens replay
    # piecewise CUDA graphs (0: eager)
    prefill_graph_max_tokens: int = 512
    # BATCHRUN_LORA_FUSED_MAX_TOKENS: steps of at most this many tokens add LoRA deltas inside
    # the kernel after each projection; larger ones run shrink + expand launches
    lora_fused_max_tokens: int = 8192
    # BATCHRUN_NUM_KV_BLOCKS: a fixed KV block count instead of sizing from memory (tests force
    # preemption with a tiny cache)
    num_kv_blocks: int | None = None

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("bool",) and not isinstance(v, bool):
                raise ConfigError(f"{env_name(f.name)}: expected true or false, got {v!r}")
            if f.type in ("int", "int | None") and v is not None and (
                    isinstance(v, bool) or not isinstance(v, int) or v < (1 if f.name == "num_kv_blocks" else 0)):
                raise ConfigError(f"{env_name(f.name)}: expected an integer >= "
                                  f"{1 if f.name == 'num_kv_blocks' else 0}, got {v!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Experiments":
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = environ.get(env_name(f.name))
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f.name, f.type, raw)
        return cls(**values)


def env_name(field_name: str) -> str:
    return PREFIX + ("MIXED_STEPS" if field_name == "mixed_steps" else field_name.upper())


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse(name: str, typ: str, raw: str):
    text = raw.strip().lower()
    if typ == "bool":
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ConfigError(f"{env_name(name)}={raw!r}: expected one of 1/0, true/false, on/off")
    if typ == "int | None" and text in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{env_name(name)}={raw!r}: expected an integer") from None
