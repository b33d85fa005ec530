"""Object-store failures as batchrun reports them.

Every failure that survives the retries (``retry.py``) stops the run with exit 7 (OUTPUT_IO,
"the data cannot be read or written") and a message naming the URI, what the store said, and the
fix: a missing bucket, refused credentials, no route to the endpoint. Retrying those would only
hide them; throttling, 5xx answers and dropped connections are retried before they get here.
"""
from __future__ import annotations

from batchrun.errors import ConfigError, OutputIOError


class StorageError(OutputIOError):
    """An object store refused or failed a request (after retries). Exit 7."""


# The store's error code -> the fix to print (S3 codes; pyarrow spells them in capitals).
_FIXES = {
    "NoSuchBucket": "the bucket does not exist: check the URI's bucket name (and the endpoint/region)",
    "AccessDenied": "the credentials may not do this: check the bucket policy or use other credentials",
    "AllAccessDisabled": "access to the bucket is disabled: check the bucket or use another one",
    "InvalidAccessKeyId": "the access key is unknown to the store: check AWS_ACCESS_KEY_ID / the profile",
    "SignatureDoesNotMatch": "the secret key does not match the access key: check AWS_SECRET_ACCESS_KEY / the profile",
    "ExpiredToken": "the session token has expired: renew the credentials (AWS_SESSION_TOKEN / the profile)",
    "InvalidToken": "the session token is invalid: check AWS_SESSION_TOKEN / the profile",
    "NoCredentials": "no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile",
    "SlowDown": "the store kept throttling past $AWS_MAX_ATTEMPTS attempts: rerun later, or raise AWS_MAX_ATTEMPTS",
    "503": "the store kept answering 503 (throttled or unavailable) past $AWS_MAX_ATTEMPTS attempts: rerun later, "
           "or raise AWS_MAX_ATTEMPTS",
    "500": "the store kept failing past $AWS_MAX_ATTEMPTS attempts: rerun later, or raise AWS_MAX_ATTEMPTS",
    "InternalError": "the store kept failing past $AWS_MAX_ATTEMPTS attempts: rerun later, or raise AWS_MAX_ATTEMPTS",
    "Unreachable": "the store cannot be reached: check the endpoint (AWS_ENDPOINT_URL / storage_options) "
                   "and the network",
}
# gs:// URIs: Google's names for the same failures, and fixes in Google's configuration terms
_GCS_FIXES = {
    **_FIXES,
    "Forbidden": "the credentials may not do this: grant them a role on the bucket (roles/storage.objectViewer "
                 "to read, roles/storage.objectUser to write an output) or use other credentials "
                 "(GOOGLE_APPLICATION_CREDENTIALS)",
    "Unauthorized": "the credentials were refused (expired or revoked): run `gcloud auth application-default "
                    "login` again or check GOOGLE_APPLICATION_CREDENTIALS",
    "NoCredentials": "no credentials: run `gcloud auth application-default login` or set "
                     "GOOGLE_APPLICATION_CREDENTIALS (on GCE/GKE the metadata server provides them)",
    "TooManyRequests": "the store kept answering 429 past $AWS_MAX_ATTEMPTS attempts: rerun later, or raise "
                       "AWS_MAX_ATTEMPTS",
    "Unreachable": "the store cannot be reached: check the endpoint (storage_options.endpoint_url / "
                   "STORAGE_EMULATOR_HOST) and the network",
}
# google.api_core's exception classes -> the codes above (a 5xx keeps its number)
_GOOGLE_NAMES = {"NotFound": "NotFound", "Forbidden": "Forbidden", "Unauthorized": "Unauthorized",
                 "TooManyRequests": "TooManyRequests"}
# pyarrow's S3 errors carry the SDK's enum names ("AWS Error NO_SUCH_BUCKET ...")
_ARROW_NAMES = {"NO_SUCH_BUCKET": "NoSuchBucket", "ACCESS_DENIED": "AccessDenied",
                "INVALID_ACCESS_KEY_ID": "InvalidAccessKeyId", "SIGNATURE_DOES_NOT_MATCH": "SignatureDoesNotMatch",
                "EXPIRED_TOKEN": "ExpiredToken", "NETWORK_CONNECTION": "Unreachable",
                "InvalidAccessKeyId": "InvalidAccessKeyId", "SignatureDoesNotMatch": "SignatureDoesNotMatch",
                "AccessDenied": "AccessDenied", "NoSuchBucket": "NoSuchBucket",
                # pyarrow's GCS errors carry google-cloud-cpp's status codes
                "PERMISSION_DENIED": "Forbidden", "UNAUTHENTICATED": "Unauthorized"}


def _message(uri: str, what: str, code: str, detail: str) -> str:
    fixes = _GCS_FIXES if uri.startswith("gs://") else _FIXES
    fix = fixes.get(code, "check the URI and the store")
    return f"{what}: {uri}: {code}: {detail.strip() or code}. Fix: {fix}; then rerun the same command"


def refusal(uri: str, what: str, code: str, detail: str) -> StorageError:
    """A StorageError for a failure a store implementation recognised itself (``code`` picks the fix)."""
    return StorageError(_message(uri, what, code, detail))


def storage_error(e: BaseException, uri: str, what: str) -> Exception:
    """The exception to raise for ``e`` (from boto3/botocore, google-cloud-storage or pyarrow) on ``uri``."""
    google = _google_error(e, uri, what)
    if google is not None:
        return google
    try:
        import botocore.exceptions as be
    except ImportError:  # only pyarrow was involved
        be = None
    if be is not None:
        if isinstance(e, be.ClientError):
            err = e.response.get("Error", {})
            code = str(err.get("Code") or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or "error")
            if code == "403":
                code = "AccessDenied"
            return StorageError(_message(uri, what, code, str(err.get("Message") or "")))
        if isinstance(e, be.NoCredentialsError):
            return StorageError(_message(uri, what, "NoCredentials", str(e)))
        if isinstance(e, be.ProfileNotFound):
            return ConfigError(f"{what}: {uri}: {e}; fix storage_options.profile or AWS_PROFILE")
        if isinstance(e, (be.EndpointConnectionError, be.ConnectionClosedError, be.ConnectTimeoutError,
                          be.ReadTimeoutError)):
            return StorageError(_message(uri, what, "Unreachable", str(e)))
        if isinstance(e, be.BotoCoreError):
            return StorageError(_message(uri, what, type(e).__name__, str(e)))
    if isinstance(e, OSError):
        text = str(e)
        code = next((name for key, name in _ARROW_NAMES.items() if key in text), None)
        if code is None and "HTTP status 403" in text:
            code = "AccessDenied"
        return StorageError(_message(uri, what, code or "error", text))
    return e


def _google_error(e: BaseException, uri: str, what: str) -> Exception | None:
    """``e`` from google-cloud-storage / google-auth / requests as a StorageError, or None."""
    try:
        import google.api_core.exceptions as gx
        import google.auth.exceptions as ga
    except ImportError:
        return None
    if isinstance(e, gx.GoogleAPICallError):
        code = getattr(e, "code", None)
        name = _GOOGLE_NAMES.get(type(e).__name__) or (str(int(code)) if code else type(e).__name__)
        return StorageError(_message(uri, what, name, str(getattr(e, "message", "") or e)))
    if isinstance(e, ga.DefaultCredentialsError):
        return StorageError(_message(uri, what, "NoCredentials", str(e)))
    if isinstance(e, ga.RefreshError):
        return StorageError(_message(uri, what, "Unauthorized", str(e)))
    if isinstance(e, ga.TransportError):  # the token endpoint or metadata server cannot be reached
        return StorageError(_message(uri, what, "Unreachable", str(e)))
    if uri.startswith("gs://"):
        import requests
        if isinstance(e, (requests.exceptions.ConnectionError, requests.exceptions.Timeout, ConnectionError)):
            return StorageError(_message(uri, what, "Unreachable", str(e)))
    return None
