"""S3 (and S3-compatible servers): Parquet read through pyarrow's S3FileSystem, everything that
needs an object's ETag (stat, listing) through boto3, the AWS SDK for Python.

Configuration is the AWS tools' own: the endpoint from ``storage_options.endpoint_url``, else
``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``; region and credentials from boto3's usual
chain (``AWS_REGION``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_PROFILE``, ~/.aws, instance/pod roles). Without a profile in storage_options, pyarrow
reads the same chain through the AWS C++ SDK (and refreshes temporary credentials itself); with
one, pyarrow gets the profile's credentials as boto3 resolved them at start-up.
"""
from __future__ import annotations

import os
from functools import cached_property
from urllib.parse import urlparse

from batchrun.errors import ConfigError
from batchrun.job.storage import retry
from batchrun.job.storage.base import Got, ObjectInfo, ObjectReads
from batchrun.job.storage.errors import storage_error
from batchrun.job.storage.options import StorageOptions
from batchrun.job.storage.uri import Uri, parse_uri

EXTRA = "pip install 'batchrun[s3]'"


def endpoint_url(options: StorageOptions) -> str | None:
    return (options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or None)


class S3Reads(ObjectReads):
    """The input side: objects' sizes and ETags, listings, Parquet (S3Storage below adds writes)."""

    def __init__(self, options: StorageOptions, field: str):
        self.options, self.field = options, field  # field: input.path / output.path, for messages
        self.endpoint = endpoint_url(options)
        self._buckets_seen: set[str] = set()  # buckets a HEAD found (a set's add is thread-safe)

    # ---- clients (built on first use; both are thread-safe) -----------------------------------

    @cached_property
    def session(self):
        try:
            import boto3
        except ImportError:
            raise ConfigError(f"{self.field}: s3:// paths need boto3, which is not installed; {EXTRA}") from None
        import botocore.exceptions as be
        try:
            return boto3.session.Session(profile_name=self.options.profile, region_name=self.options.region)
        except be.ProfileNotFound as e:
            raise ConfigError(f"{self.field}: {e}; fix storage_options.profile (or AWS_PROFILE)") from None

    @cached_property
    def client(self):
        return self.session.client("s3", endpoint_url=self.endpoint, config=retry.botocore_config())

    @cached_property
    def arrow(self):
        from pyarrow.fs import S3FileSystem
        kw = {"retry_strategy": retry.arrow_retry_strategy()}
        region = self.session.region_name
        if region:
            kw["region"] = region
        if self.endpoint:
            url = urlparse(self.endpoint)
            kw["endpoint_override"] = url.netloc + url.path.rstrip("/")
            kw["scheme"] = url.scheme
        if self.options.profile:  # the C++ SDK cannot be told a profile: hand it the resolved keys
            creds = self.session.get_credentials()
            if creds is not None:
                frozen = creds.get_frozen_credentials()
                kw.update(access_key=frozen.access_key, secret_key=frozen.secret_key,
                          session_token=frozen.token)
        return S3FileSystem(**kw)

    def _uri(self, path: str) -> Uri:
        return parse_uri(path, self.field)

    # ---- reading ------------------------------------------------------------------------------

    def stat(self, path: str) -> ObjectInfo | None:
        u = self._uri(path)
        import botocore.exceptions as be
        try:
            head = self.client.head_object(Bucket=u.bucket, Key=u.key)
        except be.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code"))
            if code in ("404", "NoSuchKey", "NotFound"):
                if self._bucket_missing(u):
                    raise storage_error(_no_such_bucket(e), path, self.field) from None
                return None
            if code == "403":  # a HEAD answer has no body to say why: a listing's answer does
                try:
                    self.client.list_objects_v2(Bucket=u.bucket, Prefix=u.key, MaxKeys=1)
                except Exception as why:  # noqa: BLE001 - translated (or re-raised) by storage_error
                    raise storage_error(why, path, self.field) from None
            raise storage_error(e, path, self.field) from None
        except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
            raise storage_error(e, path, self.field) from None
        return ObjectInfo(path, int(head["ContentLength"]), head["ETag"])

    def _bucket_missing(self, u: Uri) -> bool:
        """HEAD answers a plain 404 for a missing key and a missing bucket alike; ask the bucket
        (once per bucket: the protocol HEADs many keys that are not there yet)."""
        if u.bucket in self._buckets_seen:
            return False
        import botocore.exceptions as be
        try:
            self.client.head_bucket(Bucket=u.bucket)
        except be.ClientError as e:
            return str(e.response.get("Error", {}).get("Code")) in ("404", "NoSuchBucket", "NotFound")
        self._buckets_seen.add(u.bucket)
        return False

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``'s key, sorted by key (all pages)."""
        u = self._uri(prefix)
        found = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=u.bucket, Prefix=u.key)
            for page in pages:
                for obj in page.get("Contents", ()):
                    found.append(ObjectInfo(f"{u.scheme}://{u.bucket}/{obj['Key']}", int(obj["Size"]), obj["ETag"]))
        except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
            raise storage_error(e, prefix, self.field) from None
        return sorted(found, key=lambda o: o.path)


def _no_such_bucket(e):
    """``e`` (a 404 ClientError) recast as the NoSuchBucket it was."""
    import botocore.exceptions as be
    return be.ClientError({"Error": {"Code": "NoSuchBucket", "Message": "The specified bucket does not exist"}},
                          e.operation_name)


# ---- writing (the output protocol on S3: batchrun/job/store/objects/) ---------------------------

MULTIPART_THRESHOLD = 64 << 20  # bigger bodies go up as a multipart upload, visible only once complete
MULTIPART_PART = 16 << 20


def _precondition_failed(e) -> bool:
    err = e.response.get("Error", {})
    return str(err.get("Code")) in ("PreconditionFailed", "412", "ConditionalRequestConflict") or \
        e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412)


def _server_now(response) -> float:
    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if date:
        from email.utils import parsedate_to_datetime
        return parsedate_to_datetime(date).timestamp()
    import time
    return time.time()


class S3Writes:
    """Whole-object writes, conditional writes, reads with ETag, deletes (mixed into S3Storage)."""

    def get(self, path: str) -> Got | None:
        u = self._uri(path)
        import botocore.exceptions as be
        try:
            r = self.client.get_object(Bucket=u.bucket, Key=u.key)
            data = r["Body"].read()
        except be.ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in ("NoSuchKey", "404"):
                return None
            raise storage_error(e, path, self.field) from None
        except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
            raise storage_error(e, path, self.field) from None
        return Got(data, r["ETag"], r["LastModified"].timestamp(), _server_now(r))

    def put(self, path: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str | None:
        """Write ``data`` as the whole object; its ETag, or None when the condition failed
        (``if_none_match``: only if no object is there; ``if_match``: only if it is still that
        version). A body past MULTIPART_THRESHOLD goes up in parts and appears only when complete."""
        u = self._uri(path)
        cond = {}
        if if_none_match:
            cond["IfNoneMatch"] = "*"
        if if_match is not None:
            cond["IfMatch"] = if_match
        import botocore.exceptions as be
        try:
            if len(data) > MULTIPART_THRESHOLD:
                return self._multipart(u, data, cond)
            return self.client.put_object(Bucket=u.bucket, Key=u.key, Body=data, **cond)["ETag"]
        except be.ClientError as e:
            if cond and _precondition_failed(e):
                # botocore retried after a failed attempt (a 5xx, a dropped connection): that
                # attempt may have been applied with its answer lost, and the retry then fails its
                # own condition. The object holding exactly these bytes means the write is ours
                # (lease bodies carry the owner's token and a counter: no other writer makes them)
                if e.response.get("ResponseMetadata", {}).get("RetryAttempts"):
                    now = self.get(path)
                    if now is not None and now.data == data:
                        return now.etag
                return None
            raise storage_error(e, path, self.field) from None
        except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
            raise storage_error(e, path, self.field) from None

    def _multipart(self, u: Uri, data: bytes, cond: dict) -> str:
        up = self.client.create_multipart_upload(Bucket=u.bucket, Key=u.key)["UploadId"]
        try:
            parts = []
            for n, lo in enumerate(range(0, len(data), MULTIPART_PART), start=1):
                r = self.client.upload_part(Bucket=u.bucket, Key=u.key, UploadId=up, PartNumber=n,
                                            Body=data[lo:lo + MULTIPART_PART])
                parts.append({"ETag": r["ETag"], "PartNumber": n})
            return self.client.complete_multipart_upload(Bucket=u.bucket, Key=u.key, UploadId=up,
                                                         MultipartUpload={"Parts": parts}, **cond)["ETag"]
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=u.bucket, Key=u.key, UploadId=up)
            except Exception:  # noqa: BLE001 - the store drops abandoned uploads by its lifecycle rules
                pass
            raise

    def delete(self, path: str, *, if_match: str | None = None) -> bool:
        """Delete the object (only that version, with ``if_match``); False if the condition failed."""
        u = self._uri(path)
        import botocore.exceptions as be
        try:
            if if_match is None:
                self.client.delete_object(Bucket=u.bucket, Key=u.key)
            else:
                self.client.delete_object(Bucket=u.bucket, Key=u.key, IfMatch=if_match)
        except be.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code"))
            if code in ("NoSuchKey", "404"):
                return if_match is None
            if if_match is not None and _precondition_failed(e):
                return False
            raise storage_error(e, path, self.field) from None
        except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
            raise storage_error(e, path, self.field) from None
        return True

    def delete_many(self, paths: list[str]) -> None:
        """Delete objects of one bucket, a thousand per request."""
        if not paths:
            return
        u = self._uri(paths[0])
        keys = [self._uri(p).key for p in paths]
        for lo in range(0, len(keys), 1000):
            try:
                r = self.client.delete_objects(Bucket=u.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[lo:lo + 1000]], "Quiet": True})
            except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
                raise storage_error(e, paths[lo], self.field) from None
            errors = r.get("Errors") or []
            if errors:
                e = errors[0]
                raise storage_error(OSError(f"{e.get('Code')}: {e.get('Message')}"),
                                    f"{u.scheme}://{u.bucket}/{e.get('Key')}", self.field)


class S3Storage(S3Writes, S3Reads):
    """S3 for both sides: reads (S3Reads) and the output protocol's writes (S3Writes)."""
