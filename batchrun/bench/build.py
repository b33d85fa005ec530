"""Engines for the benchmarks: an EngineConfig built from the flags, random weights for a preset
(or a model directory's checkpoint), random adapters, random prompts and their requests."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchrun.bench.adapters import write_random_adapters
from batchrun.bench.presets import PRESETS, is_preset, preset_config
from batchrun.engine.config import EngineConfig, SamplingParams
from batchrun.engine.engine import Engine, max_position, resolve_device
from batchrun.engine.request import Request
from batchrun.errors import ConfigError
from batchrun.engine.models.config import ModelConfig
from batchrun.engine.models.quant import with_quantization
from batchrun.engine.kv_sizing import check_weights_fit
from batchrun.engine.models.loader import random_model, resolve_dtype


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


def build_engine(config: EngineConfig, num_adapters: int = 0, lora_rank: int = 16,
                 adapter_root: str | Path | None = None) -> Built:
    """A preset name (config.model) builds random weights on the device; anything else is a model
    directory. With LoRA, `num_adapters` random rank-`lora_rank` adapters are written under
    adapter_root and loaded through the engine's normal adapter path."""
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    mcfg = with_quantization(model_config_of(config.model), config.quantization)
    device = resolve_device(config.device)
    before = _allocated(device)
    adapters: dict[str, str] = {}
    if config.enable_lora and num_adapters > 0:
        if adapter_root is None:
            raise ValueError("adapter_root is needed to write the random adapters")
        adapters = write_random_adapters(adapter_root, mcfg, num_adapters, lora_rank,
                                         seed=config.seed, base_model=config.model)
    try:
        if is_preset(config.model):
            dtype = resolve_dtype(config.dtype, mcfg, device)
            check_weights_fit(mcfg, config, device, dtype)  # as a model directory's start-up
            model = random_model(mcfg, device, dtype, max_position(config, mcfg), seed=config.seed)
            engine = Engine.from_model(config, model, None, adapters or None)
            weights = "random"
        else:
            engine = Engine.from_config(config, adapters or None)
            weights = "checkpoint"
    except torch.OutOfMemoryError as e:
        if config.experiments.num_kv_blocks is None:
            raise
        raise ConfigError(f"out of device memory building an engine with num_kv_blocks="
                          f"{config.experiments.num_kv_blocks} (the KV budget forced to match the other "
                          f"engine); lower --max-num-seqs or --num-kv-blocks ({e})") from None
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
