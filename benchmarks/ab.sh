#!/usr/bin/env bash
# Old against new on ONE card in one device call, interleaved: each run of benchmarks/targets.sh
# (latency, matrix, offline, tp-matrix) goes old then new, the next round new then old, so
# drift of the card and the host hits both sides alike. Prints a short table last
# (benchmarks/summary.py --ab); the full results go to $OUT (OUT defaults to /tmp/out).
#
#   bash benchmarks/ab.sh OLD NEW [RUN ...]        (RUNs: targets.sh's; default latency matrix offline)
#
# OLD and NEW: a directory holding a tree (`.` = this one), a tar file of one (`git archive`;
# gzip is fine), or a revision of this checkout's git. A tar from `git archive <commit>` names its
# commit; otherwise set OLD_COMMIT / NEW_COMMIT, which the result JSONs record. OLD_ENV / NEW_ENV
# (e.g. "BATCHRUN_PDL=0") are set for that side only: the same tree twice with two settings of an
# experiment switch (batchrun/engine/envs.py) is an A/B of the switch. ROUNDS (default 1)
# repeats every run; TP_KV_BLOCKS sizes tp-matrix (targets.sh).
#
# A device call has 10 minutes: latency + matrix + offline take ~8 min for both trees on an H100,
# tp-matrix ~5 min; split them over calls (only $OUT's files come back: 8 at most, so the
# results are one tar). From a checkout, for instance:
#   echo /.ab/ >> .git/info/exclude; mkdir -p .ab
#   git archive -o .ab/old.tar.gz <old sha>; git archive -o .ab/new.tar.gz <new sha>
#   run (carry .ab): bash benchmarks/ab.sh .ab/old.tar.gz .ab/new.tar.gz latency matrix offline
#   run (carry .ab): bash benchmarks/ab.sh .ab/old.tar.gz .ab/new.tar.gz tp-matrix
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OLD=${1:?usage: ab.sh OLD NEW [RUN ...]}
NEW=${2:?usage: ab.sh OLD NEW [RUN ...]}
shift 2
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(latency matrix offline)
ROUNDS=${ROUNDS:-1}
OUT="${OUT:-/tmp/out}"
RES=$(mktemp -d /tmp/ab-results.XXXX)
mkdir -p "$OUT"

prepare() {  # SPEC SIDE -> prints "DIR COMMIT"
  local spec=$1 dir=/tmp/ab-tree-$2 commit=""
  if [ -d "$spec" ]; then
    dir=$(cd "$spec" && pwd)
    commit=$(git -C "$dir" rev-parse HEAD 2>/dev/null)
  else
    rm -rf "$dir" && mkdir -p "$dir"
    if [ -f "$spec" ]; then
      tar -xf "$spec" -C "$dir" || { echo "cannot unpack $spec" >&2; return 1; }
      commit=$( (gzip -dc "$spec" 2>/dev/null || cat "$spec") | git get-tar-commit-id 2>/dev/null)
    else
      git -C "$ROOT" archive "$spec" | tar -x -C "$dir" \
        || { echo "$spec is neither a directory, a tar file nor a revision here" >&2; return 1; }
      commit=$(git -C "$ROOT" rev-parse "$spec")
    fi
  fi
  echo "$dir ${commit:-unknown}"
}
read -r old_dir old_commit < <(prepare "$OLD" old)
read -r new_dir new_commit < <(prepare "$NEW" new)
[ -n "${old_dir:-}" ] && [ -n "${new_dir:-}" ] || exit 2
old_commit=${OLD_COMMIT:-$old_commit}
new_commit=${NEW_COMMIT:-$new_commit}
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "card: ${card:-none}; old $old_commit ($old_dir) ${OLD_ENV:-}; new $new_commit ($new_dir) ${NEW_ENV:-}"

one() {  # SIDE RUN ROUND
  local dir commit envs
  if [ "$1" = old ]; then dir=$old_dir commit=$old_commit envs=${OLD_ENV:-}
  else dir=$new_dir commit=$new_commit envs=${NEW_ENV:-}; fi
  local t0=$SECONDS
  # targets.sh of THIS script's tree runs the commands, so both sides run the same workloads
  env $envs BATCHRUN_COMMIT="$commit" OUT="$RES" TAG="-$1-r$3" TREE="$dir" \
    bash "$ROOT/benchmarks/targets.sh" "$2" | sed "s/^/  /"
  echo "  ($1 $2 round $3: $((SECONDS - t0)) s)"
}
for r in "${runs[@]}"; do
  for ((k = 1; k <= ROUNDS; k++)); do
    if ((k % 2)); then one old "$r" "$k"; one new "$r" "$k"
    else one new "$r" "$k"; one old "$r" "$k"; fi
  done
done
tar -czf "$OUT/ab-results.tar.gz" -C "$RES" .
python3 "$ROOT/benchmarks/summary.py" --ab "$RES" | tee "$OUT/ab-summary.txt"
