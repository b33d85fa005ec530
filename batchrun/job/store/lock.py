"""One lock per (output dir, task id): two runs of the same task must not write the same units.

POSIX ``fcntl.lockf`` locks (not ``flock``) because they also work on NFS, where Slurm users keep
their outputs. The kernel drops the lock when the process dies, even on kill -9, so a crashed run
never leaves a stale lock behind. The file holds the owner's host and pid for the error message.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time


class LockBusy(RuntimeError):
    pass


class TaskLock:
    """``block``: wait for the holder instead of raising LockBusy (for locks held only for a few
    system calls, like claims.lock)."""

    def __init__(self, path: str, what: str, block: bool = False):
        self.path, self.what, self.block, self.fd = path, what, block, None

    def acquire(self) -> "TaskLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | (0 if self.block else fcntl.LOCK_NB))
        except OSError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise LockBusy(f"{self.what} is already running ({owner}; lock {self.path}). "
                           "Wait for it to finish, or stop it first.") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()} pid {os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def acquire_waiting(lock, timeout: float, on_wait=None, poll: float = 0.2):
    """``lock.acquire()``, retried every ``poll`` s while another process holds it; ``on_wait``
    gets the first refusal (LockBusy). Past ``timeout`` s the last refusal is raised. ``lock``: a
    TaskLock, or an object store's ObjectLock (store/objects/lock.py), which raise the same."""
    deadline = time.monotonic() + timeout
    waiting = False
    while True:
        try:
            return lock.acquire()
        except LockBusy as e:
            if not waiting and on_wait is not None:
                on_wait(e)
            waiting = True
            if time.monotonic() > deadline:
                raise
            time.sleep(poll)


def is_locked(path: str) -> str | None:
    """Owner text if some process holds the lock at ``path``, else None (for status/restart)."""
    if not os.path.exists(path):
        return None
    # Read-only and a shared lock: works on a read-only directory too, and conflicts with the
    # exclusive lock a running task holds.
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.read(fd, 200).decode(errors="replace").strip() or "another process"
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
