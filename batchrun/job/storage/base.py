"""The storage interface the input side reads through: one implementation per kind of store.

``LocalStorage`` (local.py) is what batchrun always did (paths handed to pyarrow, ``os.stat``);
``S3Storage`` (s3.py) and ``GcsStorage`` (gcs.py) read objects. An object's ``version`` is what
changes when its content is replaced: the mtime (ns) of a local file, the ETag of an S3 object,
the generation of a GCS object. Inputs are pinned by
(size, version) so a run notices a file replaced under it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchrun.job.storage.errors import storage_error


@dataclass(frozen=True)
class ObjectInfo:
    path: str  # the local path or the full URI
    size: int
    version: str  # local: mtime_ns as text; S3: the ETag (quotes included, as the store sends it);
    # GCS: the generation (as text)


@dataclass(frozen=True)
class Got:
    """An object's bytes as an object store's ``get`` returns them (the output protocol's reads)."""
    data: bytes
    etag: str  # what a conditional write names to mean "this version": S3's ETag, GCS's generation
    last_modified: float  # the store's clock (epoch s): when this version was written
    now: float  # the store's clock when it answered (its Date header): lease ages need no local clock


class Storage(ABC):
    @abstractmethod
    def stat(self, path: str) -> ObjectInfo | None:
        """The file's size and version, or None if there is none at ``path``."""

    @abstractmethod
    def parquet_file(self, path: str) -> pq.ParquetFile:
        """An open Parquet file: footer read, row groups read on demand (bounded memory)."""

    @abstractmethod
    def read_schema(self, path: str) -> pa.Schema:
        """The file's schema (the footer only)."""

    @abstractmethod
    def dataset(self, path: str) -> ds.Dataset:
        """The file as a pyarrow dataset (scanned in batches)."""


class ObjectReads(Storage):
    """Parquet on an object store through a pyarrow filesystem (``self.arrow``: S3FileSystem or
    GcsFileSystem): footer first, row groups on demand. Subclasses give ``arrow``, ``_uri`` and
    ``field`` (input.path / output.path, for messages)."""

    def _open(self, path: str):
        try:
            return self.arrow.open_input_file(self._uri(path).fs_path)
        except OSError as e:
            raise storage_error(e, path, self.field) from None

    def parquet_file(self, path: str) -> pq.ParquetFile:
        # pre_buffer: a row group's column chunks are fetched in a few coalesced ranged reads
        return pq.ParquetFile(self._open(path), pre_buffer=True)

    def read_schema(self, path: str) -> pa.Schema:
        return self.parquet_file(path).schema_arrow

    def dataset(self, path: str) -> ds.Dataset:
        try:
            return ds.dataset(self._uri(path).fs_path, filesystem=self.arrow, format="parquet")
        except OSError as e:
            raise storage_error(e, path, self.field) from None
