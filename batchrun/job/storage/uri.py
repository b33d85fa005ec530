"""Object-store URIs (``s3://bucket/key``, ``gs://bucket/key``) as batchrun reads them.

A URI is kept exactly as written (never normalised as a local path: ``os.path.normpath`` would
turn ``s3://b/k`` into ``s3:/b/k``). Keys use ``/`` as the separator, as the stores' own tools
and pyarrow do; a key "directory" is a prefix ending in ``/``.
"""
from __future__ import annotations

import posixpath
import re
from typing import NamedTuple

from batchrun.errors import ConfigError

SCHEMES = ("s3", "gs")
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)\Z", re.S)


class Uri(NamedTuple):
    scheme: str  # s3 | gs
    bucket: str
    key: str  # no leading "/"; may be "" (the whole bucket)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    @property
    def fs_path(self) -> str:
        """The path pyarrow's S3/GCS filesystems take: ``bucket/key``."""
        return f"{self.bucket}/{self.key}" if self.key else self.bucket


def scheme_of(path: str) -> str | None:
    """``s3``/``gs`` (or another scheme written as ``name://``), None for a local path."""
    m = _URI.match(path)
    return m.group(1).lower() if m else None


def is_uri(path: str) -> bool:
    return scheme_of(path) is not None


def parse_uri(path: str, field: str) -> Uri:
    """Split ``scheme://bucket/key``; ConfigError naming ``field`` for a scheme batchrun cannot
    read or a URI without a bucket."""
    m = _URI.match(path)
    if m is None:
        raise ConfigError(f"{field}: {path!r} is not a URI (expected s3://bucket/key or gs://bucket/key)")
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme not in SCHEMES:
        raise ConfigError(f"{field}: {path} uses {scheme}://, which batchrun cannot read; use a local path, "
                          "s3://bucket/key or gs://bucket/key")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ConfigError(f"{field}: {path} names no bucket (expected {scheme}://bucket/key)")
    if "//" in key or key.startswith("/"):
        raise ConfigError(f"{field}: {path} has an empty path component ('//'); write the key without it")
    return Uri(scheme, bucket, key)


def join(uri: str, *names: str) -> str:
    """``uri`` + ``/name``... (keys are /-separated whatever the local OS)."""
    return posixpath.join(uri.rstrip("/"), *names)


def relpath(path: str, root: str) -> str:
    """``path`` relative to ``root`` when both are URIs (``root`` a prefix of ``path``)."""
    root = root.rstrip("/") + "/"
    assert path.startswith(root), (path, root)
    return path[len(root):]
