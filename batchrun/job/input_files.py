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

from batchrun.errors import ConfigError

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
    (an InputSpec's: absolute), by the rule in this module's docstring."""
    path = spec.path
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
    Call after find_input_files accepted ``path`` (this walk then raises nothing new)."""
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


class _Matcher:
    def __init__(self, written: str):
        self.written = written  # input.path as the user wrote it, for messages
        self.found: dict[str, None] = {}
        self.deep: set[str] = set()  # real paths of the directories a ** reads whole subtrees of

    def match(self, root: str, parts: list[str]) -> list[str]:
        if os.path.isdir(root):
            self._walk(root, [p for p in parts if p not in ("", ".")], (_identity(root),))
        files = sorted(self.found)
        seen: dict[tuple[int, int], str] = {}
        for f in files:
            key = _identity(f)
            if key in seen:
                raise ConfigError(f"input.path: {seen[key]} and {f} are the same file (reached through a "
                                  f"symlink), so {self.written} would read its rows twice; remove one of "
                                  "the links or narrow input.path")
            seen[key] = f
        return files

    def _walk(self, d: str, parts: list[str], stack: tuple) -> None:
        head, rest = parts[0], parts[1:]
        if head == "**":
            self.deep.add(os.path.realpath(d))
            if rest:
                self._walk(d, rest, stack)  # zero directories
            for name, is_dir in self._entries(d):
                full = os.path.join(d, name)
                if name.startswith(("_", ".")):
                    continue
                if is_dir:
                    key = _identity(full)
                    if key in stack:
                        raise ConfigError(f"input.path: {full} is a symlink back to a directory it is in "
                                          f"(to {os.path.realpath(full)}), a loop; remove the link, or "
                                          "give input.path as a glob that does not descend through it")
                    self._walk(full, parts, stack + (key,))
                elif not rest:
                    self._file(full)
            return
        if not is_glob(head):
            full = os.path.join(d, head)
            if rest:
                if os.path.isdir(full):
                    self._walk(full, rest, stack + (_identity(full),))
            elif os.path.lexists(full) and not os.path.isdir(full):
                self._file(full)
            return
        for name, is_dir in self._entries(d):
            full = os.path.join(d, name)
            if not fnmatchcase(name, head):
                if not rest:
                    self._check_case(full, name, head)
                continue
            if name.startswith(("_", ".")) and not head.startswith(name[0]):
                continue
            if rest:
                if is_dir:
                    self._walk(full, rest, stack + (_identity(full),))
            elif not is_dir:
                self._file(full)

    def _file(self, full: str) -> None:
        if not os.path.lexists(full):
            raise ConfigError(f"input.path: {full} disappeared while batchrun listed the input; rerun once "
                              "the input is complete")
        if not os.path.exists(full):
            raise ConfigError(f"input.path: {full} is a broken symlink (to {os.readlink(full)}) where "
                              f"{self.written} looks for inputs; remove it or restore its target")
        self.found[full] = None

    def _check_case(self, full: str, name: str, head: str) -> None:
        ext = name[-len(_EXT):]
        if (head.endswith(_EXT) and ext.lower() == _EXT and ext != _EXT
                and fnmatchcase(name[:-len(_EXT)] + _EXT, head) and not name.startswith(("_", "."))):
            raise ConfigError(f"input.path: {full} is named like an input but for the case of its extension "
                              f"({ext!r}, where {self.written} takes {_EXT!r}); rename it to end in "
                              f"{_EXT!r}, or move it out of the input")

    @staticmethod
    def _entries(d: str) -> list[tuple[str, bool]]:
        """(name, is a directory, links followed) of each entry, sorted; scandir's d_type spares
        a stat per entry (what os.walk relied on: cheap on network file systems)."""
        try:
            with os.scandir(d) as it:
                return sorted((e.name, _is_dir(e)) for e in it)
        except OSError as e:
            raise ConfigError(f"input.path: cannot list the input directory {d} ({e.strerror or e}); "
                              "fix its permissions or move it out of the input") from None


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a symlink; a broken one is not a directory
    except OSError:
        return False  # vanished while listed: _file says so if the pattern matches it


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)  # follows links: the directory or file itself
    return st.st_dev, st.st_ino
