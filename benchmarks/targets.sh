#!/usr/bin/env bash
# The numbers the open engine issues are judged by, in one device call (~8 min on an H200):
#   #12  `bench latency` avg <= 0.55 s; offline 1024 x (256 -> 128), engine alone >= 28k tok/s
#   #16  the latency preset's LoRA matrix keeps issue 4's targets (0 / 1 / 8 active adapters
#        <= +0.5 % with the same kernels / <= +8 % / <= +15 %); `tp-matrix`: the throughput
#        preset (batch 256, in 256, out 128: 0 / 1 / 8 active <= +0.5 % / +8 % / +10 %). Its two
#        engines hold 48 GiB of K/V each, more than an H100's 80 GB: it needs an H200 (~3 min)
# Model: Llama-2-7b-SHAPED, RANDOM bf16 weights. The targets are H200 figures: on another card
# the script still runs, and says which card it was.
#
#   BATCHRUN_COMMIT=<sha> bash benchmarks/targets.sh [latency|matrix|tp-matrix|offline ...]
#   (default: latency matrix offline, the three an H100 can also run)
#
# Order: latency, matrix, offline (the cheapest first, so a call cut short keeps the most).
# Writes $OUT/{latency,matrix,tp-matrix,offline}.{json,log} (OUT defaults to /tmp/out) and prints one
# summary line per run; the full tables are in the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(latency matrix offline)
echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
for r in "${runs[@]}"; do
  case "$r" in
    latency)
      timeout 120 python3 -m batchrun.cli bench latency --model llama-2-7b --num-iters 20 \
        --output-json "$OUT/latency.json" > "$OUT/latency.log" 2>&1
      echo "latency rc=$? (target avg <= 0.55 s)"; grep -iE "avg|decode|roofline" "$OUT/latency.log" | tail -3 ;;
    matrix)
      timeout 220 python3 -m batchrun.cli bench lora-matrix --preset latency --no-eager \
        --num-iters 20 --num-iters-warmup 3 --profile-kernels \
        --output-json "$OUT/matrix.json" > "$OUT/matrix.log" 2>&1
      echo "matrix rc=$?"; grep -A6 "^scenario" "$OUT/matrix.log"; grep -i "kernel check" "$OUT/matrix.log" | tail -1 ;;
    tp-matrix)
      timeout 330 python3 -m batchrun.cli bench lora-matrix --preset throughput --no-eager \
        --num-iters 3 --num-iters-warmup 1 --profile-kernels \
        --output-json "$OUT/tp-matrix.json" > "$OUT/tp-matrix.log" 2>&1
      echo "tp-matrix rc=$?"; grep -A6 "^scenario" "$OUT/tp-matrix.log"; grep -i "kernel check" "$OUT/tp-matrix.log" | tail -1 ;;
    offline)
      timeout 200 python3 -m batchrun.cli bench throughput --preset 7b --lora-fraction 0 \
        --workdir /tmp/targets-tp --output-json "$OUT/offline.json" > "$OUT/offline.log" 2>&1
      echo "offline rc=$? (target engine alone >= 28k tok/s)"
      grep -iE "engine alone|generation|step time" "$OUT/offline.log" | tail -4 ;;
    *) echo "unknown run '$r': choose latency, matrix, tp-matrix, offline"; exit 2 ;;
  esac
done
