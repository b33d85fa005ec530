#!/usr/bin/env bash
# The wheel as a user gets it: build it with `python -m build`, install it into a FRESH venv
# (its dependencies resolved from pyproject.toml, CPU torch via the constraints file), and run
# the demo job with it from outside the repository. CI runs this after the test suite.
#   scripts/wheel-check.sh            (needs .venv from `make venv` for the build tool)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# from a copy: setuptools leaves build/ in the source folder, and a stale build/lib could slip
# deleted files into the wheel
mkdir "$WORK/src"
tar --exclude=./.git --exclude=./.venv --exclude=./build --exclude='*.egg-info' --exclude=./demo-out \
    --exclude=./.devcopy -cf - . | tar -xf - -C "$WORK/src"
.venv/bin/python -m build --wheel --no-isolation --outdir "$WORK/dist" "$WORK/src" >"$WORK/build.log"
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet -c requirements/cpu-constraints.txt "$WORK"/dist/batchrun-*.whl
sed -e "s|\.\./demo/|$ROOT/demo/|" -e "s|\.\./demo-out|$WORK/out|" jobs/demo.yaml >"$WORK/job.yaml"
cd "$WORK"
"$WORK/venv/bin/python" - <<'PY'
import batchrun, batchrun.kernels.lora_meta as m, sys
for f in (batchrun.__file__, m.__file__):
    assert f.startswith(sys.prefix), f"{f} is not inside the fresh venv {sys.prefix}"
print("imports from", sys.prefix)
PY
OMP_NUM_THREADS=1 "$WORK/venv/bin/batchrun" run "$WORK/job.yaml"
"$WORK/venv/bin/python" - "$ROOT/demo/data/prompts.parquet" "$WORK/out" <<'PY'
import sys, pyarrow.parquet as pq
want = sorted(pq.read_table(sys.argv[1], columns=["id"]).column("id").to_pylist())
got = sorted(pq.read_table(sys.argv[2], columns=["id"]).column("id").to_pylist())
assert got == want, f"wheel demo job: {len(got)} output ids vs {len(want)} input ids"
print(f"wheel check: the demo job ran from the installed wheel, {len(got)} ids exactly once")
PY
