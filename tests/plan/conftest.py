"""The plan tests reuse the job-runner fixtures (tiny model dir with a chat template, two PEFT
adapters, job-file factory) and helpers of tests/runner."""
import importlib.util
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parent.parent / "runner"
sys.path.insert(0, str(RUNNER))

_spec = importlib.util.spec_from_file_location("runner_conftest", RUNNER / "conftest.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
tiny_model = _mod.tiny_model
make_job = _mod.make_job
