"""Locks on an object store (the planning lock, one per task id, the metrics merge): leases
(lease.py) renewed by a thread while held. The object-store form of store/lock.py's fcntl locks:
a killed holder's lock is not dropped by a kernel here; it goes stale after its lease, or at once
when a rerun on the same host finds its holder's process gone.
"""
from __future__ import annotations

import os
import secrets
import socket
import threading
import time

from batchrun.job.store.lock import LockBusy
from batchrun.job.store.objects.lease import Held, Leases, dead_here, owner_text


class ObjectLock:
    def __init__(self, store, path: str, what: str, lease_s: float, log=None):
        self.store, self.path, self.what, self.log = store, path, what, log
        self.leases = Leases(store, lease_s, {"host": socket.gethostname(), "pid": os.getpid(),
                                               "token": secrets.token_hex(8)})
        self.held: Held | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def acquire(self, wait_stale: bool = False) -> "ObjectLock":
        """Take the lock, or raise LockBusy naming its holder. ``wait_stale``: a lease that is
        not renewed (its holder's node died, a preempted task requeued elsewhere) is waited out
        (at most one lease) instead of refused; one that is renewed meanwhile is refused then."""
        held, record, _ = self.leases.acquire(self.path, take_over=dead_here)
        if held is None and wait_stale:
            held, record = self._wait_stale()
        if held is None:
            raise LockBusy(f"{self.what} is already running ({owner_text(record)}; lease {self.path}, "
                           f"stale {self.leases.lease_s:.0f} s after its holder stops renewing it). "
                           "Wait for it to finish, or stop it first.")
        self.held = held
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="batchrun-lock", daemon=True)
        self._thread.start()
        return self

    def _wait_stale(self):
        first = self.store.get(self.path)
        deadline = time.monotonic() + self.leases.lease_s + 5
        if self.log and first is not None:
            from batchrun.job.store.objects.lease import parse
            self.log(f"{self.what}: the lease {self.path} is held ({owner_text(parse(first.data))}); waiting up "
                     f"to {self.leases.lease_s:.0f} s to see whether its holder is alive")
        while time.monotonic() < deadline:
            time.sleep(min(max(self.leases.lease_s / 20, 0.1), 2.0))
            now = self.store.get(self.path)
            if first is not None and now is not None and now.etag != first.etag:
                from batchrun.job.store.objects.lease import parse
                return None, parse(now.data)  # renewed, or taken by another run: alive
            held, record, _ = self.leases.acquire(self.path, take_over=dead_here)
            if held is not None or (now is None and record is not None):
                return held, record
        return None, None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.leases.lease_s / 3):
            try:
                if not self.leases.renew(self.held):
                    self.lost = True
                    if self.log:
                        self.log(f"warning: {self.what}: the lease {self.path} was taken over (this process "
                                 "stalled past its lease)")
                    return
            except Exception as e:  # noqa: BLE001 - a renewal error must not kill the holder
                if self.log:
                    self.log(f"warning: could not renew {self.path}: {e}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self.held is not None and not self.lost:
            try:
                self.leases.release(self.held)
            except Exception:  # noqa: BLE001 - the lease goes stale on its own
                pass
        self.held = None

    def __enter__(self):
        return self if self.held is not None else self.acquire()  # acquire(wait_stale=True) may come first

    def __exit__(self, *exc):
        self.release()


def holder(store, path: str, lease_s: float) -> str | None:
    """Owner text if a live (not stale) lease stands at ``path``, else None (status, restart)."""
    leases = Leases(store, lease_s, {})
    got = store.get(path)
    if got is None:
        return None
    from batchrun.job.store.objects.lease import parse
    record = parse(got.data)
    if leases.stale(got, record) or dead_here(record):
        return None
    return owner_text(record)
