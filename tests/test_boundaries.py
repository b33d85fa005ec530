"""The engine imports nothing from the job side (batchrun/job): helpers both need live in
batchrun/common, below both. Checked twice: every import statement in batchrun/engine (at the top
of a module or inside a function), and what importing every engine module really loads."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "batchrun" / "engine"


def _job_imports(source: str, rel: Path) -> list[str]:
    """The import statements of the module at `rel` (relative to the repository) that reach
    batchrun.job, as 'file:line: statement'."""
    found = []
    package = ".".join(rel.with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(source, str(rel))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        if any(n == "batchrun.job" or n.startswith("batchrun.job.") for n in names):
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_engine_file_imports_the_job_side():
    files = sorted(ENGINE.rglob("*.py"))
    assert len(files) > 20  # the scan sees the engine package
    bad = [hit for f in files for hit in _job_imports(f.read_text(), f.relative_to(ROOT))]
    assert bad == [], "batchrun/engine imports batchrun/job (move the helper to batchrun/common):\n" \
                      + "\n".join(bad)


def test_the_scan_sees_each_form_of_import():
    # the check above can fail: each way of writing the import is found
    rel = Path("batchrun/engine/layers/x.py")
    for src in ["import batchrun.job.jobfile.spec", "from batchrun.job import preload",
                "from batchrun import job", "from ...job.spec import JobSpec",
                "def f():\n    from batchrun.job.inputs.rows import build_unit",
                "importlib.import_module('batchrun.job.run.runner')"]:
        assert len(_job_imports(src + "\n", rel)) == 1, src
    assert _job_imports("from batchrun.common.short_repr import short_repr\n"
                        "from ..lora import layer\nimport batchrun.jobs_like_name\n", rel) == []


IMPORT_ALL = r"""
import importlib, importlib.util, pkgutil, sys
# the batchrun package without running its __init__ (batchrun.api, the Python API, imports the
# job side; the engine's own imports are what this checks)
spec = importlib.util.spec_from_file_location("batchrun", ROOT + "/batchrun/__init__.py",
                                              submodule_search_locations=[ROOT + "/batchrun"])
sys.modules["batchrun"] = importlib.util.module_from_spec(spec)
sys.modules["batchrun.job"] = None  # any import of it raises, naming the importer in the traceback
import batchrun._kernels_path
batchrun._kernels_path.install()
import batchrun.engine
names = [m.name for m in pkgutil.walk_packages(batchrun.engine.__path__, "batchrun.engine.")]
for name in names:
    importlib.import_module(name)
print(len(names), sorted(m for m, mod in sys.modules.items() if m.startswith("batchrun.job") and mod is not None))
"""


def test_importing_every_engine_module_loads_no_job_module():
    code = f"ROOT = {str(ROOT)!r}\n" + IMPORT_ALL
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    count, loaded = out.stdout.split(" ", 1)
    assert int(count) > 20 and loaded.strip() == "[]", out.stdout
