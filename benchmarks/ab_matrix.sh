#!/usr/bin/env bash
# Latency-preset lora-matrix of two trees in one device call: the working tree ("new") and the
# tree with DIFF reverse-applied ("old"), one after the other on the same machine, so their
# figures compare (H200 hosts differ by 10-20 ms of LoRA time per request between sessions).
#
#   git diff OLD_COMMIT HEAD -- batchrun kernels benchmarks > .ab/ab.diff   # here, before the call
#   bash benchmarks/ab_matrix.sh .ab/ab.diff [ROUNDS]                       # on the device
#
# Writes $OUT/new.log, $OUT/old.log and their JSON under $OUT/j/; prints both tables. The
# device copy's .git may be stale, so the trees are built from the diff, not from git.
set -uo pipefail
cd "$(dirname "$0")/.."
DIFF=$(realpath "${1:?usage: ab_matrix.sh DIFF [ROUNDS]}")
ROUNDS=${2:-25}
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/j"
rm -rf /tmp/ab-old && cp -r . /tmp/ab-old && (cd /tmp/ab-old && patch -s -R -p1 < "$DIFF") \
  || { echo "the diff does not reverse-apply to this tree"; exit 2; }
run() {  # tree label
  (cd "$1" && PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" python3 -m batchrun.cli bench lora-matrix \
     --preset latency --no-eager --num-iters "$ROUNDS" --num-iters-warmup 3 \
     --output-json "$OUT/j/ml-$2.json" > "$OUT/$2.log" 2>&1)
}
run "$PWD" new
run /tmp/ab-old old
for t in new old; do echo "== $t"; grep -A6 "^scenario" "$OUT/$t.log"; done
