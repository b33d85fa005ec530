"""How often an object-store request is tried before its failure stops the run.

Throttling (SlowDown, 503), other 5xx answers, timeouts and dropped connections are transient:
both clients retry them with exponential backoff and jitter (botocore's ``standard`` mode for
boto3; pyarrow's ``AwsStandardS3RetryStrategy``, the AWS SDK's same policy, for Parquet reads).
Permanent errors (no bucket, access denied, unknown key) are not retried (errors.py).

The attempt count is ``AWS_MAX_ATTEMPTS`` as the AWS tools read it, else 10: a batch job that
waits out a throttling burst is cheaper than one that dies in it and is rerun.
"""
from __future__ import annotations

import os

from batchrun.errors import ConfigError

DEFAULT_MAX_ATTEMPTS = 10
ENV = "AWS_MAX_ATTEMPTS"


def max_attempts() -> int:
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_ATTEMPTS
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"${ENV}={raw!r}: expected a whole number of attempts >= 1 (e.g. {ENV}=10)")
    return n


def botocore_config():
    from botocore.config import Config
    # total_max_attempts counts the first try, as AWS_MAX_ATTEMPTS does (Config's max_attempts would not)
    return Config(retries={"mode": "standard", "total_max_attempts": max_attempts()})


def arrow_retry_strategy():
    from pyarrow.fs import AwsStandardS3RetryStrategy
    return AwsStandardS3RetryStrategy(max_attempts=max_attempts())
