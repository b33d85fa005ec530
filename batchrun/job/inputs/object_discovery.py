"""input.path as an object-store URI -> the input objects, by the rule local paths follow
(discovery.py): a "directory" (a key prefix) is read as ``prefix/**/*.parquet``; ``*``, ``?``,
``[...]`` match within one name, ``**`` zero or more names; names starting with ``_`` or ``.``
are skipped where a wildcard meets them (``_SUCCESS``, ``_delta_log/``) and used where written
out. Object stores have no directories, links or permission bits, so the local rules about
symlinks, loops and unreadable folders have nothing to apply to; zero-byte "folder" markers
(keys ending in ``/``) are not files. Files are sorted by URI; default ids name a file by its
key relative to the prefix (or to the glob's part before its first wildcard).
"""
from __future__ import annotations

from fnmatch import fnmatchcase

from batchrun.errors import ConfigError
from batchrun.job.storage.registry import storage_for
from batchrun.job.storage.uri import relpath

_GLOB_CHARS = set("*?[")
_EXT = ".parquet"


def _is_glob(name: str) -> bool:
    return any(c in name for c in _GLOB_CHARS)


def find_object_files(spec) -> tuple[list[str], str]:
    """(sorted URIs, root URI) for an InputSpec whose path is a URI."""
    path = spec.path
    store = storage_for(path, spec.storage_options, "input.path")
    parts = path.split("/")
    first = next((i for i, p in enumerate(parts) if i >= 3 and _is_glob(p)), None)
    if first is not None:  # a glob: list below its fixed part, match the rest name by name
        root = "/".join(parts[:first])
        pattern = parts[first:]
        files = _match(store.list(root + "/"), root, pattern, path)
        if not files:
            raise ConfigError(f"input.path: no objects match {path}")
        return files, root
    if not path.endswith("/"):
        if store.stat(path) is not None:
            return [path], path.rsplit("/", 1)[0]
    root = path.rstrip("/")
    listed = store.list(root + "/")
    if not listed:
        raise ConfigError(f"input.path: {path} does not exist (no object has that key or prefix)")
    files = _match(listed, root, ["**", "*" + _EXT], path)
    if not files:
        raise ConfigError(f"input.path: {path} holds no *.parquet objects")
    return files, root


def _match(objects, root: str, pattern: list[str], written: str) -> list[str]:
    found = []
    for obj in objects:
        if obj.path.endswith("/"):
            continue  # a "folder" marker some tools write
        names = relpath(obj.path, root).split("/")
        if _matches(names, pattern, written, obj.path):
            found.append(obj.path)
    return sorted(found)


def _matches(names: list[str], pattern: list[str], written: str, full: str) -> bool:
    if not pattern:
        return not names
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        if _matches(names, rest, written, full):  # zero names
            return True
        return bool(names) and len(names) > 1 and not names[0].startswith(("_", ".")) \
            and _matches(names[1:], pattern, written, full)
    if not names:
        return False
    name = names[0]
    if not _is_glob(head):
        return name == head and _matches(names[1:], rest, written, full)
    if not fnmatchcase(name, head):
        if not rest and len(names) == 1:
            _check_case(name, head, written, full)
        return False
    if name.startswith(("_", ".")) and not head.startswith(name[0]):
        return False
    return _matches(names[1:], rest, written, full)


def _check_case(name: str, head: str, written: str, full: str) -> None:
    ext = name[-len(_EXT):]
    if (head.endswith(_EXT) and ext.lower() == _EXT and ext != _EXT
            and fnmatchcase(name[:-len(_EXT)] + _EXT, head) and not name.startswith(("_", "."))):
        raise ConfigError(f"input.path: {full} is named like an input but for the case of its extension "
                          f"({ext!r}, where {written} takes {_EXT!r}); rename it to end in {_EXT!r}, or move "
                          "it out of the input")
