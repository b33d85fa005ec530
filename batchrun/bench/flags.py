"""Bench flags -> the one EngineConfig, so `bench latency`, `lora-matrix` and `throughput` check
engine settings with EngineConfig's own rules, reported under the flag's name."""
from __future__ import annotations

from batchrun.engine.config import EngineConfig
from batchrun.errors import ConfigError


def engine_config(**values) -> EngineConfig:
    """EngineConfig from bench flags; its messages name the flag (--max-lora-rank) instead of the
    job-file field (engine.max_lora_rank). ValueError: the CLI's usage error."""
    try:
        return EngineConfig(**values)
    except ConfigError as e:
        msg = str(e)
        if msg.startswith("engine."):
            name, rest = msg[len("engine."):].split(":", 1)
            msg = f"--{name.replace('_', '-')}:{rest}"
        raise ValueError(msg) from None


def fused_max_tokens(flag: int | None) -> int:
    """--lora-fused-max-tokens, or the engine's default when the flag is not given."""
    return EngineConfig.lora_fused_max_tokens if flag is None else flag
