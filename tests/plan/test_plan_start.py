"""`batchrun plan` imports neither torch nor transformers (plain-text prompts, tokenizer.json),
so it starts in well under a second and never reaches torch through models/loader.py."""
import os
import subprocess
import sys

from tests.helpers.jobs import demo_rows, REPO, run_cli_without

WRAPPER = ("import sys\nfrom batchrun.__main__ import entry\n"
           "try:\n    entry(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
           "print('IMPORTED', sorted(m for m in ('torch', 'transformers', 'batchrun.engine.models.loader', "
           "'batchrun.engine.engine') if m in sys.modules), code, file=sys.stderr)\n")


def _imported(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", WRAPPER, *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=120)
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("IMPORTED"))
    return r, line


def test_plan_does_not_import_torch(make_job):
    r, line = _imported("plan", make_job(demo_rows(12)))
    assert line == "IMPORTED [] 0", (line, r.stderr)
    assert "work units: 3 of up to 4 rows" in r.stdout


def test_demo_plan_does_not_import_torch():
    r, line = _imported("plan", REPO / "jobs" / "demo.yaml")
    assert line == "IMPORTED [] 0", (line, r.stderr)


def _plan_without(blocked: tuple, job, *flags):
    return run_cli_without(blocked, "plan", job, *flags, timeout=120)


def test_plan_works_where_import_torch_fails(make_job):
    for job in (make_job(demo_rows(12)), REPO / "jobs" / "demo.yaml"):
        r = _plan_without(("torch",), job)
        assert r.returncode == 0, r.stderr
        assert "prompt tokens" in r.stdout and "work units" in r.stdout


def test_plan_works_where_import_transformers_fails_without_messages(make_job):
    job = make_job(demo_rows(12))
    for flags in ((), ("--estimate-tokens",)):
        r = _plan_without(("transformers", "torch"), job, *flags)
        assert r.returncode == 0, r.stderr
        assert "work units: 3 of up to 4 rows" in r.stdout
