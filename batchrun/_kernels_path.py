"""Where `batchrun.kernels` comes from.

The Triton kernels live in the repository's top-level `kernels/` folder (the project's agreed
layout), but they are imported only as `batchrun.kernels`: `kernels` is also the name of an
unrelated package on PyPI, so it is never installed as a top-level package.

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
import importlib.util
import os
import sys

NAME = "batchrun.kernels"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(os.path.dirname(_PACKAGE), "kernels")


class _SourceKernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None  # submodules resolve through the package's __path__ (SOURCE)
        return importlib.util.spec_from_file_location(
            NAME, os.path.join(SOURCE, "__init__.py"), submodule_search_locations=[SOURCE])


def install() -> None:
    if os.path.isdir(os.path.join(_PACKAGE, "kernels")):
        return  # an installed copy
    if not os.path.isfile(os.path.join(SOURCE, "__init__.py")):
        raise ImportError(f"batchrun is neither installed with its kernels ({_PACKAGE}/kernels) nor "
                          f"a source checkout with {SOURCE}/__init__.py; reinstall it (pip install .)")
    if not any(isinstance(f, _SourceKernelsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceKernelsFinder())
