#!/usr/bin/env bash
# Issue 4's numbers on the H200, in one process: LoRA disabled vs LoRA enabled with 0 / 1 / 8
# active rank-16 adapters (all 7 projections), with CUDA graphs and eagerly, A/B interleaved.
# Model: Llama-2-7b-SHAPED, RANDOM bf16 weights (no weights can be downloaded); vLLM's
# `bench latency` workload (batch 8, input 32, output 128).
#
#   bash benchmarks/run_lora_matrix.sh [extra bench lora-matrix flags]
#
# Writes $OUT/lora_matrix.json (+ .log, nvidia-smi snapshot); OUT defaults to
# benchmarks/results. Where the tree is a copy without .git, set BATCHRUN_COMMIT=<sha> so the
# JSON names the commit. ~3-5 min on an H200: two 13.5 GB models, two capture passes, then
# 3 warm-up + 15 timed rounds (graph scenarios; the eager ones run in the first 6 rounds).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv > "$OUT/nvidia_smi.csv" 2>/dev/null || true
PYTHONPATH=. python3 -m batchrun.cli bench lora-matrix --model llama-2-7b \
  --batch-size 8 --input-len 32 --output-len 128 \
  --num-iters-warmup 3 --num-iters 15 --num-iters-eager 6 \
  --max-loras 8 --max-lora-rank 16 --lora-rank 16 \
  --profile-kernels --output-json "$OUT/lora_matrix.json" "$@" 2>&1 | tee "$OUT/lora_matrix.log"
