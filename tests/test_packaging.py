"""kernels/ is installed as batchrun.kernels, without a symlink, the same files in every way of
running batchrun: a wheel (built with `python -m build`), and a source checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COPY_IGNORE = (".git", ".venv", "build", "*.egg-info", "__pycache__", "demo-out", ".devcopy")


def test_no_symlink_in_the_package():
    links = [str(p) for p in (ROOT / "batchrun").rglob("*") if p.is_symlink()]
    assert links == []


def test_pyproject_lists_every_package():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "batchrun").rglob("__init__.py")} | {"batchrun.kernels"}
    assert set(cfg["packages"]) == on_disk
    assert cfg["package-dir"] == {"batchrun.kernels": "kernels"}


def test_source_checkout_imports_the_repository_kernels():
    code = "import batchrun.kernels.lora_meta as m, batchrun.kernels as k; print(m.__file__); print(*k.__path__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.split()
    assert out == [str(ROOT / "kernels" / "lora_meta.py"), str(ROOT / "kernels")]


def test_the_kernels_folder_does_not_shadow_a_kernels_package(tmp_path):
    # The unrelated PyPI package `kernels` (transformers imports it when installed) must win over
    # the repository's kernels/ folder when Python runs from the repository root, where the
    # current directory comes first on sys.path. A stand-in installed after it on sys.path:
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("from_pypi = True\n")
    code = "import kernels, batchrun.kernels.lora_meta as m; print(kernels.__file__); print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{site}"}
                         ).stdout.split()
    assert out == [str(site / "kernels" / "__init__.py"), str(ROOT / "kernels" / "lora_meta.py")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # from a copy: setuptools leaves build/ in the source folder, and a stale build/lib there
    # could slip files deleted since into a later wheel
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*COPY_IGNORE))
    # --no-isolation: build with this environment's setuptools (no index needed)
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out),
                    str(src)], check=True, capture_output=True, cwd=out)
    (whl,) = out.glob("batchrun-*.whl")
    return whl


def test_wheel_holds_the_kernels_as_batchrun_kernels(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    kernels = {n.split("/", 2)[2] for n in names if n.startswith("batchrun/kernels/")}
    assert kernels == {p.name for p in (ROOT / "kernels").glob("*.py")}
    assert not any(n.startswith("kernels/") for n in names), "no top-level `kernels` package"
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "batchrun").rglob("*.py")}
    assert sources <= set(names)


@pytest.mark.slow
def test_installed_wheel_imports_its_own_files(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    code = "import batchrun, batchrun.kernels.lora_meta as m; print(batchrun.__file__); print(m.__file__)"
    files = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, env=env,
                           capture_output=True, text=True).stdout.split()
    assert all(f.startswith(str(target)) for f in files), files
    # the demo job run from a fresh venv with the wheel's declared dependencies: scripts/wheel-check.sh (CI)
