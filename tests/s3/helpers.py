"""Job files and output reading for the object-store tests (tests/s3 and tests/gcs)."""
from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from tests.helpers.jobs import write_job


def job_file(tmp_path, tiny_model, input_path, output_path, name="job.yaml", **inp):
    return write_job(tmp_path / name, {
        "model": tiny_model["model"], "adapters": dict(tiny_model["adapters"]),
        "input": {"path": input_path, "id_column": "id", "prompt_column": "prompt", "adapter_column": "adapter",
                  "rows_per_unit": 4, **inp},
        "output": {"path": output_path}, "sampling": {"max_tokens": 8},
        "engine": {"device": "cpu", "max_model_len": 128, "max_num_seqs": 8}})


def keys(bucket, prefix: str) -> list[str]:
    """The bucket's keys under ``prefix`` (``bucket``: tests/s3's Bucket or tests/gcs's GcsBucket)."""
    return bucket.list_keys(prefix)


def read_parts(bucket, prefix: str) -> pa.Table | None:
    """The job's part files (part-NNNNNN.parquet directly under the prefix) as one table."""
    import re
    tables = []
    for key in keys(bucket, prefix.rstrip("/") + "/part-"):
        if not re.fullmatch(r"part-\d{6}\.parquet", key.rsplit("/", 1)[1]):
            continue
        tables.append(pq.read_table(io.BytesIO(bucket.read(key))))
    return pa.concat_tables(tables) if tables else None


def sorted_rows(table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: (r["id"], r.get("sample_index") or 0))
