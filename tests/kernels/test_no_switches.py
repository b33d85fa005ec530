"""kernels/ holds no mutable module-level switches: a kernel's behaviour is fixed by its
launcher's arguments, its module constants, and variables read once at import (kernels/pdl.py).
No module rebinds a global (`global`), keeps a mutable table at module level that a setter
could change, or defines a set_* function."""
import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict"}


def _switches(source: str, name: str) -> list[str]:
    found = []
    tree = ast.parse(source, name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{name}:{node.lineno}: global {', '.join(node.names)}")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("set_"):
            found.append(f"{name}:{node.lineno}: def {node.name}")
    for node in tree.body:  # module level only
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", None) in _MUTABLE_CALLS):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_mutable_module_level_switches():
    files = sorted(KERNELS.glob("*.py"))
    assert len(files) > 10
    bad = [hit for f in files for hit in _switches(f.read_text(), f.name)]
    assert bad == [], "\n".join(bad)


def test_the_scan_finds_each_kind_of_switch():
    assert len(_switches("ENABLED = False\ndef set_x(v):\n    global ENABLED\n    ENABLED = v\n",
                         "m.py")) == 2
    assert len(_switches("TUNED: dict[tuple, int] = {}\n", "m.py")) == 1
    assert len(_switches("_CACHE = dict()\n", "m.py")) == 1
    assert _switches("CONFIG = (32, 128, 6, 4)\nMAX: int = 16\ndef f():\n    d = {}\n", "m.py") == []
