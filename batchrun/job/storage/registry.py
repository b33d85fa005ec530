"""storage_for: the Storage that reads a path; clients made once per process and settings."""
from __future__ import annotations

import os
import threading

from batchrun.job.storage.base import Storage
from batchrun.job.storage.local import LOCAL
from batchrun.job.storage.options import StorageOptions
from batchrun.job.storage.uri import is_uri, parse_uri

# the environment a client reads once when it is made: a changed value makes a new client
_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_MAX_ATTEMPTS",
        "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT")
_stores: dict[tuple, Storage] = {}
_mu = threading.Lock()


def storage_for(path: str, options: StorageOptions | None = None, field: str = "input.path") -> Storage:
    if not is_uri(path):
        return LOCAL
    uri = parse_uri(path, field)
    options = options or StorageOptions()
    # the pid: a forked child makes its own clients (a client's pooled connections are not fork-safe)
    key = (uri.scheme, options, field, os.getpid(), tuple(os.environ.get(k) for k in _ENV))
    with _mu:
        if key not in _stores:
            if uri.scheme == "gs":
                from batchrun.job.storage.gcs import GcsStorage
                _stores[key] = GcsStorage(options, field)
            else:
                from batchrun.job.storage.s3 import S3Storage
                _stores[key] = S3Storage(options, field)
        return _stores[key]
