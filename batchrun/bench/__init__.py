"""Benchmarks: `batchrun bench latency` and `batchrun bench lora-matrix` (see cli.py).

Random-weight presets (presets.py) stand in for real checkpoints, which cannot be downloaded
here; random PEFT adapters (adapters.py) go through the engine's normal adapter loading.
"""
