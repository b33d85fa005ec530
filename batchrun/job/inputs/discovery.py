"""input.path -> the input files: one rule for directories and globs.

``input.path`` is one file, a directory, or a glob. A directory ``D`` is read as the glob
``D/**/*.parquet``, through the same code, so the two forms always find the same files:

- ``*``, ``?`` and ``[...]`` match within one name, case-sensitively; ``**`` as a whole component
  matches zero or more directories.
- Names starting with ``_`` or ``.`` (files and folders: ``_SUCCESS``, ``_delta_log/``,
  ``.tmp/``) are skipped where a wildcard or the directory walk meets them, as pyarrow's dataset
  reader skips them; a name written out in input.path (``data/_staging/*.parquet``), or matched
  by a pattern that itself starts with ``_``/``.``, is used.
- Symlinks to files and to directories are followed. A link that leads back to a directory it
  sits in (a loop) is refused, naming it; so is a file reached by two paths (its rows would be
  read twice), a broken link the pattern matches, and a directory that cannot be listed: a file
  is never skipped silently.
- A file named like ``*.parquet`` but for the case of its extension (``x.PARQUET``) where the
  pattern asks for ``.parquet`` is refused with the fix, not skipped.
- Files are sorted by path. Default ids name a file by its path relative to the directory (or
  to the glob's part before its first wildcard), through the links as written, not resolved.
"""
from __future__ import annotations

import os
from fnmatch import fnmatchcase
from typing import NamedTuple

from batchrun.errors import ConfigError
from batchrun.job.storage.uri import is_uri

_GLOB_CHARS = set("*?[")
_EXT = ".parquet"


def is_glob(path: str) -> bool:
    return any(c in path for c in _GLOB_CHARS)


def glob_root(pattern: str) -> str:
    """The part of a glob before its first wildcard component (names default ids, bounds output)."""
    root = pattern
    while is_glob(root):
        root = os.path.dirname(root)
    return root


def find_input_files(spec) -> tuple[list[str], str]:
    """Return (sorted file paths, root dir used to name default ids) for ``spec.path``
    (an InputSpec's: absolute), by the rule in this module's docstring; an s3:// URI by the same
    rule over the store's listing (object_discovery.py)."""
    path = spec.path
    if is_uri(path):
        from batchrun.job.inputs.object_discovery import find_object_files
        return find_object_files(spec)
    if is_glob(path):
        root = glob_root(path)
        files = _Matcher(path).match(root, os.path.relpath(path, root).split(os.sep))
        if not files:
            raise ConfigError(f"input.path: no files match {path}")
    elif os.path.isdir(path):
        root = path
        files = _Matcher(path).match(root, ["**", "*" + _EXT])
        if not files:
            raise ConfigError(f"input.path: directory {path} holds no *.parquet files")
    elif os.path.lexists(path):
        if not os.path.exists(path):
            raise ConfigError(f"input.path: {path} is a broken symlink (to {os.readlink(path)})")
        files, root = [path], os.path.dirname(path)
    else:
        raise ConfigError(f"input.path: {path} does not exist")
    for f in files:
        if not os.access(f, os.R_OK):
            raise ConfigError(f"input.path: {f} is not readable (permissions)")
    return files, root


def deep_input_dirs(path: str) -> set[str]:
    """Real paths of the directories whose whole subtree ``path`` (a directory or a glob with
    ``**``) reads, links followed: an output directory inside one would be read back as input.
    Call after find_input_files accepted ``path`` (this walk then raises nothing new). None for a
    URI: an object store holds no local directory an output could lie in."""
    if is_uri(path):
        return set()
    if is_glob(path):
        root = glob_root(path)
        parts = os.path.relpath(path, root).split(os.sep)
    elif os.path.isdir(path):
        root, parts = path, ["**", "*" + _EXT]
    else:
        return set()
    matcher = _Matcher(path)
    matcher.match(root, parts)
    return matcher.deep


class _Entry(NamedTuple):
    name: str
    is_dir: bool  # links followed
    key: tuple[int, int] | None  # (st_dev, st_ino) of what it names, when known without a stat


class _Matcher:
    def __init__(self, written: str):
        self.written = written  # input.path as the user wrote it, for messages
        self.found: dict[str, tuple[int, int] | None] = {}  # path -> identity (None: stat it)
        self.deep: set[str] = set()  # real paths of the directories a ** reads whole subtrees of
        self._listed: dict[str, list[_Entry]] = {}

    def match(self, root: str, parts: list[str]) -> list[str]:
        if os.path.isdir(root):
            self._walk(root, [p for p in parts if p not in ("", ".")], (_identity(root),))
        files = sorted(self.found)
        seen: dict[tuple[int, int], str] = {}
        for f in files:
            key = self.found[f] or _identity(f)
            if key in seen:
                raise ConfigError(f"input.path: {seen[key]} and {f} are the same file (reached through a "
                                  f"symlink), so {self.written} would read its rows twice; remove one of "
                                  "the links or narrow input.path")
            seen[key] = f
        return files

    def _walk(self, d: str, parts: list[str], stack: tuple) -> None:
        """Match ``parts`` below directory ``d``; ``stack``: identities of the directories from the
        root down to ``d`` (the last is d's own)."""
        head, rest = parts[0], parts[1:]
        if head == "**":
            self.deep.add(os.path.realpath(d))
            if rest:
                self._walk(d, rest, stack)  # zero directories
            for e in self._entries(d, stack[-1][0]):
                full = os.path.join(d, e.name)
                if e.name.startswith(("_", ".")):
                    continue
                if e.is_dir:
                    key = _identity(full)
                    if key in stack:
                        raise ConfigError(f"input.path: {full} is a symlink back to a directory it is in "
                                          f"(to {os.path.realpath(full)}), a loop; remove the link, or "
                                          "give input.path as a glob that does not descend through it")
                    self._walk(full, parts, stack + (key,))
                elif not rest:
                    self._file(full, e.key)
            return
        if not is_glob(head):
            full = os.path.join(d, head)
            if rest:
                if os.path.isdir(full):
                    self._walk(full, rest, stack + (_identity(full),))
            elif os.path.lexists(full) and not os.path.isdir(full):
                self._file(full, None)
            return
        for e in self._entries(d, stack[-1][0]):
            full = os.path.join(d, e.name)
            if not fnmatchcase(e.name, head):
                if not rest:
                    self._check_case(full, e.name, head)
                continue
            if e.name.startswith(("_", ".")) and not head.startswith(e.name[0]):
                continue
            if rest:
                if e.is_dir:
                    self._walk(full, rest, stack + (_identity(full),))
            elif not e.is_dir:
                self._file(full, e.key)

    def _file(self, full: str, key: tuple[int, int] | None) -> None:
        if key is None:  # a symlink (or an entry that vanished while listed): what does it name?
            if not os.path.lexists(full):
                raise ConfigError(f"input.path: {full} disappeared while batchrun listed the input; rerun "
                                  "once the input is complete")
            if not os.path.exists(full):
                raise ConfigError(f"input.path: {full} is a broken symlink (to {os.readlink(full)}) where "
                                  f"{self.written} looks for inputs; remove it or restore its target")
        self.found[full] = key

    def _check_case(self, full: str, name: str, head: str) -> None:
        ext = name[-len(_EXT):]
        if (head.endswith(_EXT) and ext.lower() == _EXT and ext != _EXT
                and fnmatchcase(name[:-len(_EXT)] + _EXT, head) and not name.startswith(("_", "."))):
            raise ConfigError(f"input.path: {full} is named like an input but for the case of its extension "
                              f"({ext!r}, where {self.written} takes {_EXT!r}); rename it to end in "
                              f"{_EXT!r}, or move it out of the input")

    def _entries(self, d: str, dev: int) -> list[_Entry]:
        """The entries of directory ``d`` (on device ``dev``), sorted by name, listed once per walk.
        scandir's d_type and d_ino say which entries are directories and what a non-link names
        without a stat per entry (as os.walk relied on: stats are slow on network file systems)."""
        if d not in self._listed:
            try:
                with os.scandir(d) as it:
                    self._listed[d] = sorted((_entry(e, dev) for e in it), key=lambda e: e.name)
            except OSError as e:
                raise ConfigError(f"input.path: cannot list the input directory {d} ({e.strerror or e}); "
                                  "fix its permissions or move it out of the input") from None
        return self._listed[d]


def _entry(e: os.DirEntry, dev: int) -> _Entry:
    try:
        link = e.is_symlink()
        return _Entry(e.name, e.is_dir(), None if link else (dev, e.inode()))
    except OSError:  # vanished while listed: _file says so if the pattern matches it
        return _Entry(e.name, False, None)


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)  # follows links: the directory or file itself
    return st.st_dev, st.st_ino
