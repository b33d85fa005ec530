"""Google Cloud Storage: Parquet read through pyarrow's GcsFileSystem, everything that needs an
object's generation (stat, listing, the output protocol's reads and writes) through
google-cloud-storage, Google's client for Python.

Why two clients: pyarrow's filesystem reads Parquet a row group at a time (ranged reads, bounded
memory) but exposes neither generations nor preconditions; the Python client sends
``ifGenerationMatch`` (``0``: only if no object is there; a generation: only if it is still that
version) on uploads and deletes, which the output protocol's claims, leases and manifest stand on.

Configuration is Google's tools' own: credentials from application default credentials
(``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, the metadata server
on GCE/GKE), the project from ``GOOGLE_CLOUD_PROJECT`` or the credentials (object requests need
none). ``STORAGE_EMULATOR_HOST`` (the variable google-cloud-storage itself honours) points both
clients at a GCS-compatible server, with anonymous credentials. ``storage_options.endpoint_url``
wins over the environment (with ADC credentials unless STORAGE_EMULATOR_HOST is set).
``storage_options.profile`` is S3's and is refused (options.py); ``region`` means nothing to
reads and writes of existing buckets and is ignored, as gsutil ignores a location there.

Large bodies: google-cloud-storage sends a body above 8 MiB as a resumable upload, which GCS
shows only once it is finalized (a visible part is never partial); its precondition is sent when
the session starts and GCS evaluates it when the upload is finalized, so a conditional put stays
conditional on that path too.

Got.now is the store's clock: the Date header of the response that carried the bytes, caught by a
response hook on the HTTP session. Each thread gets its own client and session (the protocol reads
commit markers from a pool of threads), so the hook's value is always this thread's last answer.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from functools import cached_property

from batchrun.errors import ConfigError
from batchrun.job.storage import retry
from batchrun.job.storage.base import Got, ObjectInfo, ObjectReads
from batchrun.job.storage.errors import StorageError, refusal, storage_error
from batchrun.job.storage.options import StorageOptions
from batchrun.job.storage.uri import Uri, parse_uri

EXTRA = "pip install 'batchrun[gcs]'"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
DELETE_THREADS = 16  # GCS deletes one object per request: a few in flight hide the round trips
GET_TRIES = 5  # an object replaced between a get's metadata read and its bytes: read it again


def _with_scheme(endpoint: str) -> str:
    return endpoint if endpoint.startswith(("http://", "https://")) else "http://" + endpoint


def endpoint_url(options: StorageOptions) -> str | None:
    emulator = os.environ.get(EMULATOR_ENV, "").strip()
    return options.endpoint_url or (_with_scheme(emulator) if emulator else None)


def _import(field: str):
    try:
        from google.cloud import storage
    except ImportError:
        raise ConfigError(f"{field}: gs:// paths need google-cloud-storage, which is not installed; {EXTRA}") from None
    return storage


class _Local(threading.local):
    client = None
    date: str | None = None  # the Date header of this thread's last response


class GcsReads(ObjectReads):
    """The input side: objects' sizes and generations, listings, Parquet (GcsStorage adds writes)."""

    def __init__(self, options: StorageOptions, field: str):
        if options.profile:
            raise ConfigError(f"{field.rsplit('.', 1)[0]}.storage_options.profile: profiles are S3's (~/.aws/config); "
                              "gs:// paths take Google's application default credentials: remove the field and set "
                              "GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`")
        _import(field)
        self.options, self.field = options, field  # field: input.path / output.path, for messages
        self.endpoint = endpoint_url(options)
        self.emulator = bool(os.environ.get(EMULATOR_ENV, "").strip())
        self._local = _Local()
        self._buckets_seen: set[str] = set()
        self._creds = None  # (credentials, project), resolved on first use
        self._mu = threading.Lock()

    # ---- clients ------------------------------------------------------------------------------

    def _credentials(self, path: str):
        """(credentials, project): anonymous for an emulator, else application default credentials."""
        with self._mu:
            if self._creds is None:
                project = os.environ.get("GOOGLE_CLOUD_PROJECT") or None
                if self.emulator:
                    from google.auth.credentials import AnonymousCredentials
                    self._creds = (AnonymousCredentials(), project)
                else:
                    import google.auth
                    try:
                        creds, found = google.auth.default(scopes=[SCOPE])
                    except Exception as e:  # noqa: BLE001 - DefaultCredentialsError and its causes
                        raise storage_error(e, path, self.field) from None
                    self._creds = (creds, project or found)
            return self._creds

    def client(self, path: str):
        """This thread's client (its own HTTP session, whose hook records the store's Date)."""
        if self._local.client is None:
            storage = _import(self.field)
            creds, project = self._credentials(path)
            if self.emulator:  # anonymous: nothing to sign or refresh (an AuthorizedSession would try on a 401)
                import requests
                session = requests.Session()
            else:
                from google.auth.transport.requests import AuthorizedSession
                session = AuthorizedSession(creds)
            local = self._local

            def remember_date(response, *args, **kwargs):
                local.date = response.headers.get("Date")

            session.hooks["response"].append(remember_date)
            kw = {"client_options": {"api_endpoint": self.endpoint}} if self.endpoint else {}
            client = storage.Client(project=project, credentials=creds, _http=session, **kw)
            # Recent clients fetch each bucket's metadata in a background thread, for trace
            # attributes only: batchrun records no traces, and that request needs
            # storage.buckets.get, which an object-only role (roles/storage.objectUser) lacks
            if getattr(client, "_bucket_metadata_cache", None) is not None:
                client._bucket_metadata_cache = None
            self._local.client = client
        return self._local.client

    def server_now(self) -> float:
        """The store's clock at this thread's last answer (its Date header)."""
        if not self._local.date:
            raise StorageError(f"{self.field}: the store's answer had no Date header; lease ages need the "
                               "store's clock. Fix: use a GCS-compatible server that sends Date")
        return parsedate_to_datetime(self._local.date).timestamp()

    @cached_property
    def arrow(self):
        from pyarrow.fs import GcsFileSystem
        kw = {"retry_time_limit": retry.gcs_retry_time_limit()}
        if self.endpoint:
            scheme, _, rest = self.endpoint.partition("://")
            kw.update(scheme=scheme, endpoint_override=rest.rstrip("/"))
        if self.emulator:
            kw["anonymous"] = True
        project = os.environ.get("GOOGLE_CLOUD_PROJECT")
        if project:
            kw["project_id"] = project
        return GcsFileSystem(**kw)  # without anonymous: google-cloud-cpp reads the same ADC chain

    def _uri(self, path: str) -> Uri:
        return parse_uri(path, self.field)

    def _call(self, path: str, fn):
        """``fn(retry)`` with a fresh attempt count; google's errors become StorageError (exit 7)."""
        try:
            return fn(retry.GcsAttempts().retry)
        except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
            raise storage_error(e, path, self.field) from None

    def _bucket(self, u: Uri, path: str):
        return self.client(path).bucket(u.bucket)

    # ---- reading ------------------------------------------------------------------------------

    def stat(self, path: str) -> ObjectInfo | None:
        u = self._uri(path)
        blob = self._call(path, lambda r: self._bucket(u, path).get_blob(u.key, retry=r))
        if blob is None:
            self._check_bucket(u, path)
            return None
        return ObjectInfo(path, int(blob.size), str(blob.generation))

    def _check_bucket(self, u: Uri, path: str) -> None:
        """A missing object and a missing bucket both answer 404 to an object request: ask the
        bucket (once per bucket: the protocol stats many keys that are not there yet)."""
        if u.bucket in self._buckets_seen:
            return
        exists = self._call(path, lambda r: self._bucket(u, path).exists(retry=r))
        if not exists:
            raise refusal(path, self.field, "NoSuchBucket", f"bucket {u.bucket} does not exist")
        self._buckets_seen.add(u.bucket)

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose name starts with ``prefix``'s key, sorted by name (all pages)."""
        u = self._uri(prefix)

        def listing(r):
            blobs = self.client(prefix).list_blobs(u.bucket, prefix=u.key or None, retry=r)
            return [ObjectInfo(f"gs://{u.bucket}/{b.name}", int(b.size), str(b.generation)) for b in blobs]

        try:
            found = self._call(prefix, listing)
        except StorageError as e:
            if ": NotFound:" in str(e):  # a listing answers 404 only for its bucket
                raise refusal(prefix, self.field, "NoSuchBucket", f"bucket {u.bucket} does not exist") from None
            raise
        return sorted(found, key=lambda o: o.path)


def _google_exceptions():
    import google.api_core.exceptions as gx
    return gx


class GcsWrites:
    """Whole-object writes with generation preconditions, reads with the generation, deletes
    (mixed into GcsStorage; the same return conventions as S3Writes)."""

    def get(self, path: str) -> Got | None:
        return self._get(path)

    def _get(self, path: str) -> Got | None:
        """The object's bytes and generation: its metadata, then its bytes pinned to that
        generation (``ifGenerationMatch``), so the two always belong together."""
        u = self._uri(path)
        gx = _google_exceptions()
        for _ in range(GET_TRIES):
            blob = self._call(path, lambda r: self._bucket(u, path).get_blob(u.key, retry=r))
            if blob is None:
                self._check_bucket(u, path)
                return None
            try:
                # a fresh handle: the metadata's mediaLink names the host that wrote the object,
                # which need not be this client's endpoint
                data = self._bucket(u, path).blob(u.key).download_as_bytes(
                    if_generation_match=blob.generation, retry=retry.GcsAttempts().retry)
            except (gx.PreconditionFailed, gx.NotFound):  # replaced or deleted since the metadata read
                continue
            except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
                raise storage_error(e, path, self.field) from None
            return Got(data, str(blob.generation), blob.updated.timestamp(), self.server_now())
        raise refusal(path, self.field, "Conflict", f"the object changed {GET_TRIES} times while it was read")

    def put(self, path: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str | None:
        """Write ``data`` as the whole object; its generation, or None when the condition failed
        (``if_none_match``: only if no object is there; ``if_match``: only if it is still that
        generation). A body above 8 MiB goes as a resumable upload, visible only once finalized.

        A conditional write retried after a failed attempt (a 503, a dropped connection) may come
        back 412 because that attempt was applied and only its answer was lost: then the object
        is read back, and if it holds exactly these bytes the write is ours (lease bodies carry
        the owner's token and a counter, so no other writer produces them)."""
        if if_none_match and if_match is not None:
            raise ValueError("put: if_none_match and if_match exclude each other")
        cond = 0 if if_none_match else (int(if_match) if if_match is not None else None)
        u = self._uri(path)
        gx = _google_exceptions()
        blob = self._bucket(u, path).blob(u.key)
        attempts = retry.GcsAttempts()
        try:
            blob.upload_from_string(data, content_type="application/octet-stream",
                                    if_generation_match=cond, retry=attempts.retry)
        except gx.PreconditionFailed:
            if cond is None:
                raise storage_error(gx.PreconditionFailed("412 unexpected without a condition"), path,
                                    self.field) from None
            if attempts.failed:
                now = self._get(path)
                if now is not None and now.data == data:
                    return now.etag
            return None
        except gx.NotFound:  # an upload answers 404 only for its bucket
            raise refusal(path, self.field, "NoSuchBucket", f"bucket {u.bucket} does not exist") from None
        except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
            raise storage_error(e, path, self.field) from None
        return str(blob.generation)

    def delete(self, path: str, *, if_match: str | None = None) -> bool:
        """Delete the object (only that generation, with ``if_match``); False if the condition failed."""
        return self._delete(path, if_match=if_match)

    def _delete(self, path: str, *, if_match: str | None = None) -> bool:
        u = self._uri(path)
        gx = _google_exceptions()
        blob = self._bucket(u, path).blob(u.key)
        cond = int(if_match) if if_match is not None else None
        try:
            blob.delete(if_generation_match=cond, retry=retry.GcsAttempts().retry)
        except gx.NotFound:
            self._check_bucket(u, path)
            return if_match is None
        except gx.PreconditionFailed:
            if if_match is not None:
                return False
            raise storage_error(gx.PreconditionFailed("412 unexpected without a condition"), path,
                                self.field) from None
        except Exception as e:  # noqa: BLE001 - translated (or re-raised) by storage_error
            raise storage_error(e, path, self.field) from None
        return True

    def delete_many(self, paths: list[str]) -> None:
        """Delete objects (one request each, a few in flight); objects already gone are fine."""
        if not paths:
            return
        with ThreadPoolExecutor(DELETE_THREADS) as pool:
            list(pool.map(self._delete, paths))


class GcsStorage(GcsWrites, GcsReads):
    """GCS for both sides: reads (GcsReads) and the output protocol's writes (GcsWrites)."""
