"""Local (POSIX) files: pyarrow opens the path itself, as batchrun always did."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchrun.job.storage.base import ObjectInfo, Storage


class LocalStorage(Storage):
    def stat(self, path: str) -> ObjectInfo | None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return ObjectInfo(path, st.st_size, str(st.st_mtime_ns))

    def parquet_file(self, path: str) -> pq.ParquetFile:
        return pq.ParquetFile(path)

    def read_schema(self, path: str) -> pa.Schema:
        return pq.read_schema(path)

    def dataset(self, path: str) -> ds.Dataset:
        return ds.dataset(path, format="parquet")


LOCAL = LocalStorage()
