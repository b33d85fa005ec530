#!/usr/bin/env bash
# One lent-GPU call, several steps, logs under $OUT (the device tool brings $OUT back).
#
#   bash benchmarks/device_run.sh STEP [STEP ...]
#
# Steps (each writes $OUT/<step>.log; a failing step is recorded and the next one still runs):
#   env        GPU, driver, python/torch/triton versions, bytecode settings
#   gputests   pytest -m gpu over tests/ (xgrammar from .whl/ when carried)
#   latency    bench latency, 7b preset (batch 8, in 32, out 128)
#   pyc        compile site-packages' bytecode as `pip install` does (the image ships none and
#              sets PYTHONDONTWRITEBYTECODE, so every process would compile torch/transformers)
#
# Wheels carried in .whl/ (structured-output tests: xgrammar and its needs) are installed into
# /tmp/site first. Extra steps are plain shell: STEP may also be "cmd:<shell command>" (its log:
# $OUT/cmd-<position>.log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# Pass BATCHRUN_COMMIT=<hash> from the machine that launches the call: the device copy's .git can
# be stale (session 9: runs of bbb314e..aa7ae7a recorded a1f73e2, fixed by hand in their JSON).
export BATCHRUN_COMMIT="${BATCHRUN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
summary=()
n=0
for step in "$@"; do
  n=$((n + 1))
  log="$OUT/${step%%:*}.log"
  [[ $step == cmd:* ]] && log="$OUT/cmd-$n.log"
  t0=$(date +%s%N)
  case "$step" in
    env) { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
           python3 -c 'import sys, torch, triton; print(sys.version); print(torch.__version__, triton.__version__)'
           env | grep -E '^PYTHON' ; } > "$log" 2>&1 ;;
    pyc) sp=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
         (cd "$sp" && python3 -m compileall -q -j 0 torch transformers triton tokenizers safetensors \
            pyarrow numpy huggingface_hub jinja2 yaml click tqdm sympy networkx filelock fsspec regex \
            packaging) > "$log" 2>&1 ;;
    gputests) python3 -m pytest -m gpu -q -p no:cacheprovider tests > "$log" 2>&1 ;;
    latency) python3 -m batchrun.cli bench latency --model llama-2-7b \
               --output-json "$OUT/latency.json" > "$log" 2>&1 ;;
    cmd:*) bash -c "${step#cmd:}" > "$log" 2>&1 ;;
    *) echo "unknown step $step" > "$log"; false ;;
  esac
  rc=$?
  summary+=("$(printf '%-10s rc=%-3s %6ss' "${step%%:*}" "$rc" "$(( ($(date +%s%N) - t0) / 1000000000 ))")")
done
echo "=== steps"
printf '%s\n' "${summary[@]}"
