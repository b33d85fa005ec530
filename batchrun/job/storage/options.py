"""``storage_options`` in job.yaml: what the environment cannot say about an object store.

Everything else comes from where the stores' own tools look: for S3 the AWS variables
(``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_PROFILE``, ``AWS_MAX_ATTEMPTS``)
and ``~/.aws/config``/``credentials``; for GCS Google's application default credentials
(``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's ADC, the metadata server), ``STORAGE_EMULATOR_HOST``
and ``GOOGLE_CLOUD_PROJECT`` (gcs.py). A
field set here wins over the environment. Secrets have no field: a job file is copied into the
output's manifest, so credentials stay in the environment or the profile files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.errors import ConfigError

FIELDS = {
    "endpoint_url": "the store's address, e.g. http://127.0.0.1:9000 (an S3-compatible server)",
    "region": "the bucket's region, e.g. eu-west-1",
    "profile": "a profile of ~/.aws/config (S3 only: refused for gs://)",
}


@dataclass(frozen=True)
class StorageOptions:
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def parse_storage_options(raw: Any, where: str) -> StorageOptions:
    """``where``: the field path (``input.storage_options``) for the messages."""
    if raw is None:
        return StorageOptions()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping with some of {', '.join(FIELDS)}, got {type(raw).__name__}")
    for key, value in raw.items():
        if key not in FIELDS:
            hint = (" (credentials are read from the environment or a profile, never from the job file)"
                    if isinstance(key, str) and ("key" in key or "secret" in key or "token" in key) else "")
            raise ConfigError(f"{where}.{key}: unknown field{hint}; known: "
                              + "; ".join(f"{k}: {v}" for k, v in FIELDS.items()))
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}.{key}: expected a non-empty string ({FIELDS[key]})")
    endpoint = raw.get("endpoint_url")
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.endpoint_url: {endpoint!r} must start with http:// or https://")
    return StorageOptions(**raw)
