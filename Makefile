# batchrun: the two commands anyone needs.
#   make demo   set up .venv (first time), run the demo job on the CPU, print a few output rows
#   make test   set up .venv (first time), run the CPU test suite (what CI runs), on 2 processes
#   make test-fast  the same without the tests marked `slow` (over ~4 s each: whole engines or
#               interpreted kernels, CLI runs in subprocesses): the edit loop's subset
# Works on a fresh machine with only python3 (3.10+) and pip: everything else goes into .venv.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONSTRAINTS := requirements/cpu-constraints.txt

.PHONY: all venv test test-fast demo plan clean-demo

all: test

# torch==2.13.0 (pinned in the constraints file) is the CPU wheel; an unpinned torch would pull
# a multi-GB CUDA build. Reinstalls when pyproject.toml or the constraints change.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# TRITON_INTERPRET=1: the Triton kernels run (slowly, exactly) on the CPU; GPU-only tests skip.
# TEST_WORKERS: pytest-xdist processes (-n; 0 runs everything in this process). --dist loadscope
# hands each test module to one worker: module-scoped fixtures (reference engines) are built
# once, and a module's tests that share an external resource (tests/slurm's one node) never
# run at the same time.
TEST_WORKERS ?= 2
PYTEST := TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope
test: $(STAMP)
	$(PYTEST) -m "not gpu"

test-fast: $(STAMP)
	$(PYTEST) -m "not gpu and not slow"

# The demo model and adapters ship in demo/; they are retrained only if missing (a few minutes).
demo/model/config.json:
	$(MAKE) venv
	$(BIN)/python scripts/train_demo.py

demo: $(STAMP) demo/model/config.json
	$(BIN)/batchrun run jobs/demo.yaml --restart
	@echo
	$(BIN)/batchrun show demo-out --limit 12

plan: $(STAMP)
	$(BIN)/batchrun plan jobs/demo.yaml

clean-demo:
	rm -rf demo-out
