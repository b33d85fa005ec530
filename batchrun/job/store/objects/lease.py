"""Leases on an object store: the object-store form of a claim file or a lock file.

A lease is a small JSON object (owner: host, pid, worker, token; lease_s). It is taken with a
conditional PUT (``If-None-Match: *``: of any number of takers exactly one succeeds), renewed by
rewriting it with ``If-Match: <its ETag>`` (which also refreshes its Last-Modified), and released
by a DELETE with ``If-Match``, so an owner never renews or deletes a lease someone else took over.

Age is measured on the store's clock alone: a lease is stale when the store's ``Date`` (when it
answers the GET) is past the object's ``Last-Modified`` + ``lease_s``, so hosts with skewed
clocks still agree. A stale lease (its owner died or lost the network) is taken over with
``If-Match: <the stale ETag>``: if the owner renewed meanwhile, or another taker was first, the
ETag moved and the take-over fails. A PUT is atomic, so a lease is never half written. (On GCS
the generation plays the ETag's part: ``ifGenerationMatch``, storage/gcs.py.)
"""
from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Callable


@dataclass
class Held:
    path: str
    etag: str
    extra: dict
    seq: int = 0  # renewals so far: in the body, so that every renewal gets a new ETag


def owner_text(record: dict | None) -> str:
    if not record:
        return "another process"
    return f"host {record.get('host')} pid {record.get('pid')}"


def parse(data: bytes) -> dict | None:
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def dead_here(record: dict | None) -> bool:
    """The owner ran on this host and its process is gone (a rerun after kill -9 need not wait
    for the lease: nothing else can be renewing it)."""
    if not record or record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    if record["pid"] == os.getpid():
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Leases:
    def __init__(self, store, lease_s: float, owner: dict):
        self.store, self.lease_s, self.owner = store, lease_s, owner

    def body(self, extra: dict | None = None, seq: int = 0) -> bytes:
        # seq changes the bytes (so the ETag) of each renewal: a taker that read the lease before
        # a renewal holds an old ETag, and its If-Match fails (same bytes would keep the ETag)
        return json.dumps({**self.owner, **(extra or {}), "lease_s": self.lease_s, "seq": seq}).encode()

    def stale(self, got, record: dict | None) -> bool:
        lease = self.lease_s
        if record is not None and isinstance(record.get("lease_s"), (int, float)) and record["lease_s"] > 0:
            lease = float(record["lease_s"])
        return got.now > got.last_modified + lease

    def acquire(self, path: str, take_over: Callable[[dict | None], bool] = lambda r: False,
                extra: dict | None = None) -> tuple[Held | None, dict | None, bool]:
        """(held or None, the record that stood in the way, whether a stale lease was taken over).
        ``take_over(record)``: also take a live lease with this record (a dead earlier run of the
        same worker)."""
        extra = dict(extra or {})
        body = self.body(extra)
        etag = self.store.put(path, body, if_none_match=True)
        if etag is not None:
            return Held(path, etag, extra), None, False
        got = self.store.get(path)
        if got is None:  # released between the two requests: an ordinary take
            etag = self.store.put(path, body, if_none_match=True)
            return (Held(path, etag, extra) if etag else None), None, False
        record = parse(got.data)
        if not (self.stale(got, record) or take_over(record)):
            return None, record, False
        etag = self.store.put(path, body, if_match=got.etag)
        return (Held(path, etag, extra) if etag else None), record, etag is not None

    def renew(self, held: Held) -> bool:
        """Rewrite the lease (a fresh Last-Modified); False once someone else has taken it."""
        etag = self.store.put(held.path, self.body(held.extra, held.seq + 1), if_match=held.etag)
        if etag is None:
            return False
        held.etag, held.seq = etag, held.seq + 1
        return True

    def release(self, held: Held) -> None:
        self.store.delete(held.path, if_match=held.etag)  # only our version: a taken-over lease stays

    def mine(self, held: Held) -> bool:
        got = self.store.get(held.path)
        record = parse(got.data) if got is not None else None
        return record is not None and record.get("token") == self.owner.get("token")
