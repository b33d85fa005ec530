"""Is ``output.path`` a safe place to write (and, on --restart, to delete batchrun's files)?

Checked by `plan` and `run` before anything is written. Refused: ``/``, the home directory (or a
parent of it), a directory that holds or lies inside the input (its part files would become
inputs, and a restart would be deleting next to them), a ``_batchrun`` that is a symlink (its
target is not ours), a directory that does not belong to this job and is not empty, and a place
that cannot be written.
"""
from __future__ import annotations

import os
import re

from batchrun.errors import ConfigError
from batchrun.job.inputs.discovery import deep_input_dirs, glob_root, is_glob
from batchrun.job.jobfile.spec import JobSpec
from batchrun.job.store.layout import META, OutputDir
from batchrun.job.storage.uri import is_uri


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _inside(child: str, parent: str) -> bool:
    """child == parent or child lies below parent (both real paths)."""
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _glob_regex(pattern: str) -> re.Pattern:
    """glob.glob(recursive=True) semantics: ``**`` spans directories, ``*``/``?`` do not."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append(r"(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(r".*")
            i += 2
            continue
        if c == "*":
            out.append(r"[^/]*")
        elif c == "?":
            out.append(r"[^/]")
        elif c == "[":
            j = pattern.find("]", i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:j].replace("\\", "\\\\")
                out.append("[^" + body[1:] + "]" if body.startswith("!") else "[" + body + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


def check_output_path(spec: JobSpec, files: list[str]) -> None:
    """Static checks of output.path against the file system and the inputs (writes nothing)."""
    out = spec.output.path
    if is_uri(out):
        _check_output_prefix(spec)
        return
    real = _real(out)
    if real == os.sep:
        raise ConfigError("output.path: / is not an output directory; choose a new, empty directory")
    home = _real(os.path.expanduser("~"))
    if home != os.sep and _inside(home, real):
        raise ConfigError(f"output.path: {out} is {'your home directory' if real == home else 'a parent of your home directory'}; "
                          "choose a new, empty directory for this job's outputs (e.g. ~/runs/myjob)")
    for f in files:
        if not is_uri(f) and _inside(_real(f), real):
            raise ConfigError(f"output.path: {out} contains the input file {f}; outputs would mix with inputs. "
                              "Choose an output directory outside the input")
    ipath = spec.input.path
    if is_uri(ipath):
        pass  # inputs in an object store: no local directory of theirs can hold the output
    elif is_glob(ipath):
        written_root = glob_root(ipath)
        root = _real(written_root)
        if _inside(root, real):
            raise ConfigError(f"output.path: {out} contains the input folder {root}; choose an output "
                              "directory outside the input")
        probe = os.path.join(real, "part-000000.parquet")
        if _inside(real, root) and _glob_regex(root + ipath[len(written_root):]).match(probe):
            raise ConfigError(f"output.path: {out} lies where input.path {ipath} matches, so its part files "
                              "would be read as inputs by the next run; choose an output directory outside it")
    elif os.path.isdir(ipath):
        root = _real(ipath)
        if _inside(real, root) or _inside(root, real):
            raise ConfigError(f"output.path: {out} is {'inside' if _inside(real, root) else 'a parent of'} "
                              f"the input folder {ipath}, so its part files would be read as inputs by the "
                              "next run; choose an output directory outside the input folder")
    for d in sorted(deep_input_dirs(ipath)):  # sub-directories reached through symlinks included
        if _inside(real, d):
            raise ConfigError(f"output.path: {out} lies inside {d}, which input.path {ipath} reads (through "
                              "a symlink), so its part files would be read as inputs by the next run; choose "
                              "an output directory outside it")
    meta = os.path.join(out, META)
    if os.path.islink(meta):
        raise ConfigError(f"output.path: {meta} is a symlink (to {os.readlink(meta)}); batchrun keeps its "
                          "metadata in a real directory there and never writes or deletes through links. "
                          "Remove the link or choose another output.path")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"output.path: {out} exists and is not a directory")
    check_writable(out)


def _check_output_prefix(spec: JobSpec) -> None:
    """An s3:// output prefix must not hold the input, nor lie where the input is read from
    (checked on the names; nothing is listed or written here)."""
    out, ipath = spec.output.path.rstrip("/"), spec.input.path
    if len(out.split("/")) < 4:
        raise ConfigError(f"output.path: {out} is a whole bucket; give a prefix for this job "
                          f"(e.g. {out}/runs/myjob)")
    if not is_uri(ipath):
        return
    root = glob_root(ipath).rstrip("/") if is_glob(ipath) else ipath.rstrip("/")
    if out == root or root.startswith(out + "/"):
        raise ConfigError(f"output.path: {out} contains the input {ipath}; outputs would mix with inputs. "
                          "Choose an output prefix outside the input")
    if out.startswith(root + "/"):
        raise ConfigError(f"output.path: {out} lies under the input prefix {root}, so its part files would be "
                          "read as inputs by the next run; choose an output prefix outside it")


def check_writable(out: str) -> None:
    """The directory (or, before it exists, its nearest existing parent) can be written."""
    probe = out
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"output.path: cannot write to {out}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"output.path: cannot write to {out} ({probe} is not writable: permissions or a "
                          "read-only file system); choose a writable directory")


def foreign_entries(out: OutputDir) -> list[str]:
    """Names in output.path other than ``_batchrun`` (for a directory with no manifest)."""
    if not os.path.isdir(out.path):
        return []
    return sorted(n for n in os.listdir(out.path) if n != META)


def check_unowned_dir(out: OutputDir) -> None:
    """A directory with no manifest must be empty (apart from _batchrun/): it is not ours."""
    names = foreign_entries(out)
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ConfigError(f"output.path: {out.path} is not empty and does not hold a batchrun job "
                          f"(it has {shown}, and no _batchrun/manifest.json); batchrun only writes into a "
                          "new or empty directory, or one of its own. Choose an empty or new directory")
