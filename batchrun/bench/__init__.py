"""Benchmarks: `batchrun bench latency`, `lora-matrix` and `throughput` (see cli.py), built from
small shared pieces (build, flags, timing, record, engine_stats); they use the engine's public
API, and diagnostics that step it by hand live in benchmarks/ (step_probe.py), not here.

Random-weight presets (presets.py) stand in for real checkpoints, which cannot be downloaded
here; random PEFT adapters (adapters.py) go through the engine's normal adapter loading.
"""
