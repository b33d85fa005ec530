"""How often an object-store request is tried before its failure stops the run.

Throttling (SlowDown, 503), other 5xx answers, timeouts and dropped connections are transient:
every client retries them with exponential backoff and jitter (S3: botocore's ``standard`` mode
for boto3, pyarrow's ``AwsStandardS3RetryStrategy``, the AWS SDK's same policy, for Parquet
reads; GCS: google-cloud-storage's own retry predicate in a ``google.api_core.retry.Retry``, and
pyarrow's ``GcsFileSystem`` with a ``retry_time_limit`` for Parquet reads). Permanent errors (no
bucket, access denied, unknown key) are not retried (errors.py).

The attempt count is ``AWS_MAX_ATTEMPTS`` as the AWS tools read it, else 10: a batch job that
waits out a throttling burst is cheaper than one that dies in it and is rerun. Google's tools
have no such variable, so GCS requests use the same count (one setting for every store): a
``Retry`` counts attempts (``GcsAttempts``), and pyarrow's GCS client, which only takes a time
limit, gets the longest time that many backoffs can take.
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


# Google's backoff (google.api_core's defaults for storage): 1 s, doubling, at most 60 s a wait,
# each wait drawn uniformly below its cap (full jitter)
GCS_INITIAL_S, GCS_MULTIPLIER, GCS_MAXIMUM_S = 1.0, 2.0, 60.0


class GcsAttempts:
    """One request's attempts: a ``Retry`` (``.retry``) that retries what google-cloud-storage
    calls transient (429, 5xx, dropped connections) until ``max_attempts()`` attempts are spent,
    and counts the failed attempts (``.failed``): a conditional write that fails with 412 after a
    failed attempt may have been applied by that attempt (its answer lost), which gcs.py checks."""

    def __init__(self):
        from google.api_core.retry import Retry
        from google.cloud.storage.retry import _should_retry
        self.limit, self.failed = max_attempts(), 0

        def predicate(exc: BaseException) -> bool:
            if not _should_retry(exc):
                return False
            self.failed += 1
            return self.failed < self.limit

        # timeout=None: the attempt count bounds the retries, not a clock
        self.retry = Retry(predicate=predicate, initial=GCS_INITIAL_S, multiplier=GCS_MULTIPLIER,
                           maximum=GCS_MAXIMUM_S, timeout=None)


def gcs_retry_time_limit():
    """pyarrow's GcsFileSystem retries for a time, not a count: the longest the Python client's
    ``max_attempts()`` attempts may wait between them."""
    from datetime import timedelta
    waits = [min(GCS_INITIAL_S * GCS_MULTIPLIER ** i, GCS_MAXIMUM_S) for i in range(max_attempts() - 1)]
    return timedelta(seconds=max(sum(waits), 1.0))
