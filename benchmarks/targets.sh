#!/usr/bin/env bash
# The workloads docs/benchmarks.md's tables are made of, on ONE tree (this script's), each a
# `batchrun bench` command. Model: Llama-2-7b-SHAPED, RANDOM bf16 weights.
#   latency    `bench latency`: vLLM's default workload, batch 8, in 32, out 128 (~45 s)
#   matrix     `bench lora-matrix --preset latency`: the same batch with LoRA disabled / enabled
#              with 0, 1, 8 active rank-16 adapters, A/B interleaved, kernel check (~100 s)
#   offline    `bench throughput --preset 7b --lora-fraction 0`: 1024 x (256 -> 128), the engine
#              alone and `batchrun run` on the same rows (~80 s; the first run writes the model)
#   tp-matrix  `bench lora-matrix --preset throughput`: batch 256, in 256, out 128. Both engines
#              get TP_KV_BLOCKS KV blocks (default 2560 = 20 GiB each at 8 MiB a block), so the
#              two 7b engines fit one 80 GB H100; 256 rows need 6144 blocks, so rows are preempted
#              and recomputed, equally on both engines (the matrix checks that) (~150 s)
# Times are H100 estimates (session 18: latency + matrix + offline in 229 s).
#
#   offline:PRESET, matrix:PRESET  the offline / latency-matrix run on another model preset's
#              shape (batchrun/bench/presets.py: llama-3-8b, qwen3-8b, gemma-2-9b, gemma-3-12b, phi-4)
#
#   BATCHRUN_COMMIT=<sha> bash benchmarks/targets.sh [latency matrix offline tp-matrix offline:P matrix:P]
#   (default: latency matrix offline)
#
# Writes $OUT/<run>$TAG.json and .log (OUT defaults to /tmp/out, TAG to nothing) and prints one
# summary line per run (benchmarks/summary.py). TREE=<dir> runs that tree's code instead of this
# one's (benchmarks/ab.sh). Experiment switches are environment variables
# (batchrun/engine/envs.py): an A/B of one is two calls with the variable set differently,
# e.g. through benchmarks/ab.sh.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "${TREE:-$HERE/..}"  # TREE: run another tree's code with these commands (benchmarks/ab.sh)
OUT="${OUT:-/tmp/out}"
TAG="${TAG:-}"
TP_KV_BLOCKS="${TP_KV_BLOCKS:-2560}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(latency matrix offline)
rc_all=0
for r in "${runs[@]}"; do
  json="$OUT/${r/:/-}$TAG.json" log="$OUT/${r/:/-}$TAG.log"
  rm -f "$json"
  case "$r" in
    offline:*)
      timeout 500 "$PY" -m batchrun bench throughput --preset "${r#offline:}" --lora-fraction 0 \
        --output-json "$json" > "$log" 2>&1 ;;
    matrix:*)
      timeout 400 "$PY" -m batchrun bench lora-matrix --model "${r#matrix:}" --preset latency \
        --no-eager --num-iters 10 --num-iters-warmup 2 --profile-kernels --output-json "$json" \
        > "$log" 2>&1 ;;
    latency)
      timeout 240 "$PY" -m batchrun bench latency --model llama-2-7b --num-iters 20 \
        --output-json "$json" > "$log" 2>&1 ;;
    matrix)
      timeout 400 "$PY" -m batchrun bench lora-matrix --preset latency --no-eager \
        --num-iters 20 --num-iters-warmup 3 --profile-kernels --output-json "$json" > "$log" 2>&1 ;;
    tp-matrix)
      # The KV budget of both engines: the --num-kv-blocks flag where this tree's bench has it,
      # and BATCHRUN_NUM_KV_BLOCKS (batchrun/engine/envs.py) in any case.
      kv=()
      "$PY" -m batchrun bench lora-matrix --help 2>/dev/null | grep -q -- '--num-kv-blocks' \
        && kv=(--num-kv-blocks "$TP_KV_BLOCKS")
      BATCHRUN_NUM_KV_BLOCKS="$TP_KV_BLOCKS" timeout 500 "$PY" -m batchrun bench lora-matrix \
        --preset throughput --no-eager --num-iters 3 --num-iters-warmup 1 --profile-kernels \
        "${kv[@]}" --output-json "$json" > "$log" 2>&1 ;;
    offline)
      timeout 400 "$PY" -m batchrun bench throughput --preset 7b --lora-fraction 0 \
        --workdir /tmp/batchrun-offline --output-json "$json" > "$log" 2>&1 ;;
    *) echo "unknown run '$r': choose latency, matrix, offline, tp-matrix"; exit 2 ;;
  esac
  rc=$?
  if [ $rc -ne 0 ] || [ ! -s "$json" ]; then
    echo "$r$TAG: rc=$rc, no result; the end of $log:"; tail -5 "$log"; rc_all=1
  else
    "$PY" "$HERE/summary.py" "$json"
  fi
done
exit $rc_all
