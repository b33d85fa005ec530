"""A GCS-compatible server on localhost for the whole session (gcp-storage-emulator, installed by
the `test` extra, with generation preconditions added: preconditions.py), and per test a fresh
bucket with STORAGE_EMULATOR_HOST pointing at it.

The server is a subprocess (tests/gcs/emulator.py) on a free port, in memory, stopped at the end
of the session. Subprocesses (the CLI) reach it over HTTP: only the environment tells them where it
is, as it would tell gsutil or google-cloud-storage.
"""
from __future__ import annotations

import io
import itertools
import os
import socket
from dataclasses import dataclass

import pytest

_buckets = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_server():
    pytest.importorskip("google.cloud.storage", reason="the gcs tests need the test extra (google-cloud-storage)")
    pytest.importorskip("gcp_storage_emulator", reason="the gcs tests need the test extra (gcp-storage-emulator)")
    import subprocess
    import sys
    import time
    import urllib.request
    port = _free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "emulator.py"), str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            with urllib.request.urlopen(url + "/", timeout=1) as r:
                if r.read() == b"OK":
                    break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"the GCS emulator did not start (exit {proc.poll()})") from None
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def gcs_env(endpoint: str) -> dict:
    """The environment google-cloud-storage would be given for the test server."""
    return {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "batchrun-test", "AWS_MAX_ATTEMPTS": "3"}


@dataclass
class GcsBucket:
    """A bucket of the test server, with the few operations the tests make behind batchrun's back
    (the same methods as tests/s3's Bucket, so tests/s3/helpers.py serves both)."""
    endpoint: str
    name: str
    client: object  # a google.cloud.storage.Client of the test's own
    scheme: str = "gs"

    def uri(self, key: str = "") -> str:
        return f"gs://{self.name}/{key}"

    def write(self, key: str, data: bytes) -> None:
        self.client.bucket(self.name).blob(key).upload_from_string(data)

    def read(self, key: str) -> bytes:
        return self.client.bucket(self.name).blob(key).download_as_bytes()

    def remove(self, key: str) -> None:
        self.client.bucket(self.name).blob(key).delete()

    def list_keys(self, prefix: str) -> list[str]:
        return sorted(b.name for b in self.client.list_blobs(self.name, prefix=prefix))

    def put_rows(self, key: str, rows: list[dict], schema=None, row_group_size: int | None = None) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf, row_group_size=row_group_size)
        self.write(key, buf.getvalue())
        return self.uri(key)


def make_client(endpoint: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    return storage.Client(project="batchrun-test", credentials=AnonymousCredentials(),
                          client_options={"api_endpoint": endpoint})


@pytest.fixture
def gcs(gcs_server, monkeypatch) -> GcsBucket:
    """A new, empty bucket; this process's environment points google-cloud-storage at the test server."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    for k, v in gcs_env(gcs_server).items():
        monkeypatch.setenv(k, v)
    client = make_client(gcs_server)
    name = f"batchrun-test-{os.getpid()}-{next(_buckets)}"
    client.create_bucket(name)
    return GcsBucket(gcs_server, name, client)
