"""Generation preconditions for gcp-storage-emulator, which accepts and ignores them.

The output protocol on GCS stands on ``ifGenerationMatch`` (0: create only if absent; a
generation: replace or delete only that version). The emulator (a pure-Python GCS server, the
only one the test extra can install) never reads the parameter, so a test against it would pass
on a server that cannot race. ``install()`` wraps its object handlers so they answer 412 exactly
as GCS documents (https://cloud.google.com/storage/docs/request-preconditions): the live
object's generation (none: 0) must equal ``ifGenerationMatch``, on uploads (simple, multipart,
and a resumable upload's session start and its chunks), on deletes and on media downloads.
``install()`` also runs every handler under one lock: the server answers requests on threads
(emulator.py), and the lock makes each check and the write after it atomic and keeps the
emulator's storage, which has no locking of its own, to one request at a time; answers are sent
outside the lock, so a client slow to read one cannot hold up the others.
test_gcs_store.py probes every condition the protocol uses through the client.
"""
from __future__ import annotations

import threading
from http import HTTPStatus

_LOCK = threading.RLock()  # re-entrant: objects.get calls the (checked) download handler inside it

_ERROR = {"error": {"code": 412, "message": "At least one of the pre-conditions you specified did not hold.",
                    "errors": [{"domain": "global", "reason": "conditionNotMet", "locationType": "header",
                                "location": "If-Match",
                                "message": "At least one of the pre-conditions you specified did not hold."}]}}


def _live_generation(storage, bucket: str, name: str) -> str:
    from gcp_storage_emulator.exceptions import NotFound
    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return "0"


def _object_name(request, storage) -> str | None:
    """The object a request writes, deletes or downloads."""
    q = request.query
    if "upload_id" in q:  # a resumable upload's chunk: the session knows its object
        return storage.get_resumable_file_obj(q["upload_id"][0])["name"]
    if "name" in q:
        return q["name"][0]
    if request.params.get("object_id"):
        return request.params["object_id"]
    data = request.data
    if isinstance(data, dict) and isinstance(data.get("meta"), dict):
        return data["meta"].get("name")
    if isinstance(data, dict):
        return data.get("name")
    return None


def _serialized(handler):
    def wrapped(*args, **kwargs):
        with _LOCK:
            return handler(*args, **kwargs)

    wrapped.serialized = True
    return wrapped


def _checked(handler):
    def wrapped(request, response, storage, *args, **kwargs):
        want = request.query.get("ifGenerationMatch")
        if want:
            name = _object_name(request, storage)
            if name is not None and _live_generation(storage, request.params["bucket_name"], name) != want[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json(_ERROR)
                return None
        return handler(request, response, storage, *args, **kwargs)

    wrapped.precondition_checked = True
    return wrapped


def install() -> None:
    """Wrap the emulator's upload, delete and download handlers in the checks, and every handler
    in the lock (idempotent)."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects
    targets = {objects.insert, objects.upload_partial, objects.delete, objects.download, objects.xml_upload}
    for _, handlers in server.HANDLERS:
        for method, handler in list(handlers.items()):
            if getattr(handler, "serialized", False):
                continue
            if handler in targets:
                handler = _checked(handler)
            handlers[method] = _serialized(handler)
    # objects.get serves ?alt=media by calling objects.download directly: route it through the check
    if not getattr(objects.download, "precondition_checked", False):
        objects.download = _checked(objects.download)
