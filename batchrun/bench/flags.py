"""Bench flags -> the one EngineConfig, so `bench latency`, `lora-matrix` and `throughput` check
engine settings with EngineConfig's own rules, reported under the flag's name. The engine's
experiment switches are not flags: a benchmark reads them from the BATCHRUN_* environment
variables as every engine does (engine/envs.py) and records them with its results."""
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

