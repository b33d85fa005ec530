"""Where `batchrun.kernels` comes from.

The Triton kernels live in the repository's top-level `kernels/` folder (the project's agreed
layout), one op per module, torch references in `reference` (entry points: lora_meta.LoRAKernelMeta,
lora_shrink.lora_shrink, lora_expand.lora_expand, paged_attention.paged_decode_attention,
reference.ref_*). They are imported only as `batchrun.kernels`: `kernels` is also the name of an
unrelated package on PyPI (transformers imports it when it is installed), so batchrun never
installs a top-level `kernels`.

kernels/ has no __init__.py, so that it cannot shadow that package when Python runs from the
repository root (`python -c`, `python -m pytest` put the current directory first on sys.path):
a folder without __init__.py is only a namespace-package candidate, and Python takes a regular
`kernels` package from anywhere on sys.path before it (transformers also treats a lone namespace
`kernels` as not installed). `batchrun.kernels` is therefore a namespace package too, which
imports nothing itself, so `reference` and `lora_meta` stay usable without triton and
TRITON_INTERPRET can be set before any kernel module loads.

- Installed from a wheel or `pip install .`: pyproject.toml's `package-dir` copies kernels/ into
  the package as batchrun/kernels/, and Python finds it there; nothing here runs.
- A source checkout (`PYTHONPATH=.`, `pip install -e .`): there is no batchrun/kernels/ folder
  (and no symlink: checkouts without symlinks must work too), so `install()` puts a finder first
  on sys.meta_path that maps `batchrun.kernels` to the kernels/ folder next to this package. It
  goes first so a second checkout on PYTHONPATH (a worktree) imports its own kernels, not those
  of the checkout an editable install points at.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

NAME = "batchrun.kernels"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(os.path.dirname(_PACKAGE), "kernels")


class _SourceKernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None  # submodules resolve through the package's __path__ (SOURCE)
        # a namespace package (no loader, no __init__.py) whose one portion is SOURCE
        spec = importlib.machinery.ModuleSpec(NAME, None, is_package=True)
        spec.submodule_search_locations = [SOURCE]
        return spec


def install() -> None:
    if os.path.isdir(os.path.join(_PACKAGE, "kernels")):
        return  # an installed copy
    if not os.path.isfile(os.path.join(SOURCE, "lora_meta.py")):
        raise ImportError(f"batchrun is neither installed with its kernels ({_PACKAGE}/kernels) nor "
                          f"a source checkout with {SOURCE}/; reinstall it (pip install .)")
    if not any(isinstance(f, _SourceKernelsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceKernelsFinder())
