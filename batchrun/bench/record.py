"""What was measured, where: the command, commit, device and versions of a run, and the JSON
file (written whole through a temp file, so a reader never sees half of it)."""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch


def git_commit() -> tuple[str, bool | None]:
    """(HEAD, tree has uncommitted changes). Where the tree is a copy (a device machine, whose
    copy may carry a stale .git), BATCHRUN_COMMIT names the commit it was copied from and wins;
    without it and without git: "unknown"."""
    root = Path(__file__).resolve().parents[2]
    if os.environ.get("BATCHRUN_COMMIT"):
        return os.environ["BATCHRUN_COMMIT"], None
    fallback = "unknown"
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return fallback, None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=30)
        return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return fallback, None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device, command: str | None = None) -> dict:
    """command: the full command line (the CLI passes every flag, defaults resolved); else
    rebuilt from sys.argv."""
    commit, dirty = git_commit()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu ({platform.processor() or platform.machine()})"
    return {"command": command or shlex.join(["batchrun", *sys.argv[1:]]), "argv": list(sys.argv),
            "commit": commit, "git_dirty": dirty, "device": name,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": _version("triton"), "cuda": torch.version.cuda},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            # the experiment switches as set (engine/envs.py; BATCHRUN_PDL is the kernels')
            "batchrun_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("BATCHRUN_")}}


def write_json(path: str | Path | None, data: dict) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
