"""Dynamic work-unit claims: any number of workers share one output directory's units.

A worker claims a unit by creating ``_batchrun/claims/unit-XXXXXX`` with ``O_CREAT|O_EXCL``
(atomic on local filesystems, NFSv3+ and Lustre). The file holds the owner (host, pid, worker)
and a random token; its **mtime** is the lease: the owner's background thread touches it every
lease/3 seconds, and a claim whose mtime is older than its lease (dead node, kill -9,
preemption) may be taken over. A claim carrying this worker's own name (but another token) is
taken over at once: the runner holds the worker's lock, so it was left by a dead earlier run of
the same worker (a rerun after kill -9, a requeued Slurm task).

A claim file without a readable owner (its creator died between creating and writing it: a
kill -9 lands there now and then) is taken over once it is UNREADABLE_GRACE_S old, not after a
whole lease: a live creator writes its owner microseconds after creating the file, and nobody
renews an empty claim, so waiting for the lease only stalled the rerun (~120 s).

Taking over (stealing) is race-safe between any number of stealers: stealers take turns under
the output's ``locks/claims.lock`` (an fcntl lock, dropped by the kernel when its holder dies, so
it never goes stale), and the stealer holding it looks again, renames the expired file to a private
name, checks that what it moved is the same, still-expired file (else it links it back: the owner
renewed in between), deletes it and then creates a fresh claim with ``O_EXCL`` like any worker, so
one worker wins. Without the turns a stealer that looked before another's take-over would move the
new owner's fresh claim aside; a plain claimer finding the name free meanwhile then made two winners.

Claims make the work efficient, not exactly-once: each unit has one part-file name, published
by an atomic rename, so even two workers finishing the same unit leave one whole part file. Still,
``still_mine`` is checked right before a part is published, so the late finisher of a stolen unit
discards its result. A unit is released (its claim file deleted) after its commit, or when the
worker exits without finishing it; the claims directory therefore only holds units in flight.

Order: the worker starts at ``start`` (its share of the plan for the ``--num-tasks`` hint, so N
workers of N begin where a fixed split would have put them) and prefers units of the shard it is
in: the rest of the current shard forward, then the part of it before the cursor, then the next
shards in plan order (base shard first, LoRA shards grouped). When every unit is committed or
claimed by someone else, it yields ``None`` (so the caller runs what it holds instead of sitting
on it: two waiting workers could otherwise renew each other into a deadlock) and then waits
(polling) for those claims to commit or expire.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from typing import Callable, Iterable, Iterator

from batchrun.errors import OutputIOError, io_message
from batchrun.job.store.layout import OutputDir
from batchrun.job.store.lock import TaskLock
from batchrun.job.plan.units import Unit

DEFAULT_LEASE_S = 120.0
UNREADABLE_GRACE_S = 5.0  # a claim file with no readable owner is stale after this (or the lease)
LEASE_ENV = "BATCHRUN_CLAIM_LEASE"
# fcntl locks belong to the process, so threads of one process take turns here first.
_STEAL_TURN = threading.Lock()


def lease_from_env(value: float | None = None) -> float:
    """The lease length: ``value`` (from --claim-lease) if given, else $BATCHRUN_CLAIM_LEASE, else 120 s."""
    if value is None:
        raw = os.environ.get(LEASE_ENV, "")
        if raw.strip() == "":
            return DEFAULT_LEASE_S
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"${LEASE_ENV}={raw!r} is not a number of seconds; set e.g. {LEASE_ENV}=120") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"the claim lease must be a positive number of seconds, got {value} "
                         f"(--claim-lease or ${LEASE_ENV})")
    return float(value)


def _shard_runs(units: list[Unit]) -> list[tuple[int, int]]:
    """[lo, hi) position ranges of consecutive units of one shard (adapter, known)."""
    runs: list[tuple[int, int]] = []
    for i, u in enumerate(units):
        if runs and (units[i - 1].adapter, units[i - 1].known) == (u.adapter, u.known):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


class UnitClaims:
    """Iterate over claimed units; ``still_mine``/``release``/``close`` as the runner commits."""

    def __init__(self, out: OutputDir, units: list[Unit], worker: str, *, start: int = 0,
                 done: Iterable[int] = (), lease_s: float | None = None, poll_s: float | None = None,
                 clock: Callable[[], float] = time.time, log: Callable[[str], None] | None = None):
        self.out, self.units, self.worker = out, list(units), worker
        self.lease_s = lease_from_env(lease_s)
        self.poll_s = poll_s if poll_s is not None else min(max(self.lease_s / 20, 0.05), 2.0)
        self.clock, self.log = clock, log
        self.token = secrets.token_hex(8)
        self.owner = {"host": socket.gethostname(), "pid": os.getpid(), "worker": worker,
                      "token": self.token, "lease_s": self.lease_s}
        self.pos = {u.index: i for i, u in enumerate(self.units)}
        self.runs = _shard_runs(self.units)
        self.cursor = min(max(start, 0), max(len(self.units) - 1, 0))
        self.done: set[int] = set(done)  # committed (seen): never tried again
        self.held: dict[int, float] = {}  # unit -> when claimed
        self.lost: set[int] = set()  # claims this worker held that someone else took over
        self.stolen = 0  # expired claims this worker took over
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._setup()

    def _setup(self) -> None:
        os.makedirs(self.out.claims, exist_ok=True)

    # ---- the claim file -------------------------------------------------------------------------

    def _read(self, path: str) -> dict | None:
        try:
            with open(path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None  # missing, or created and not yet written (or its creator died there)

    def _expired(self, st: os.stat_result, data: dict | None) -> bool:
        lease = self.lease_s
        if data is None:  # no owner to wait for: its creator died before writing it
            lease = min(lease, UNREADABLE_GRACE_S)
        elif isinstance(data.get("lease_s"), (int, float)) and data["lease_s"] > 0:
            lease = float(data["lease_s"])
        return self.clock() > st.st_mtime + lease

    def _create(self, path: str) -> bool:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            try:
                os.write(fd, json.dumps({**self.owner, "claimed": self.clock()}).encode())
            finally:
                os.close(fd)
        except OSError as e:  # disk full, quota: an empty claim would look live to every worker
            try:
                os.unlink(path)
            except OSError:
                pass
            raise OutputIOError(io_message(e, "cannot claim a unit")) from None
        return True

    def _predecessor(self, data: dict | None) -> bool:
        """A claim of this worker's name but another token: left by a dead earlier run of this
        worker (the caller holds the worker's lock, so no other live process has its name)."""
        return data is not None and data.get("worker") == self.worker and data.get("token") != self.token

    def _stale(self, st: os.stat_result, data: dict | None) -> bool:
        return self._predecessor(data) or self._expired(st, data)

    def _steal(self, path: str) -> bool:
        """Take over an expired claim (or one of a dead earlier run of this worker); False if it
        is live or another worker got it first."""
        with _STEAL_TURN, TaskLock(os.path.join(self.out.locks, "claims.lock"), "taking over a claim", block=True):
            return self._steal_in_turn(path)

    def _steal_in_turn(self, path: str) -> bool:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return self._create(path)  # released meanwhile: an ordinary claim
        if not self._stale(st, self._read(path)):
            return False
        aside = f"{path}.stale-{self.token}"
        try:
            os.rename(path, aside)  # of all stealers, one moves this file
        except FileNotFoundError:
            return self._create(path)
        st2 = os.stat(aside)
        if st2.st_ino != st.st_ino or not self._stale(st2, self._read(aside)):
            # We moved a live claim (renewed since we looked, or a fresh one): put it back,
            # unless someone claimed the unit meanwhile (then that claim stands; its former owner
            # sees it lost in still_mine and discards its result).
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
            os.unlink(aside)
            return False
        os.unlink(aside)
        if self._create(path):
            self.stolen += 1
            return True
        return False

    def claim(self, unit: int) -> str:
        """'claimed', 'done' (committed), or 'busy' (someone else holds a live claim)."""
        if os.path.exists(self.out.commit_marker(unit)):
            return "done"
        path = self.out.claim(unit)
        if not (self._create(path) or self._steal(path)):
            return "busy"
        if os.path.exists(self.out.commit_marker(unit)):  # committed and released just before we claimed
            self._unlink_mine(unit)
            return "done"
        with self._mu:
            self.held[unit] = self.clock()
        return "claimed"

    # ---- iteration --------------------------------------------------------------------------

    def _order(self) -> Iterator[int]:
        """Positions from the cursor: its shard forward, its shard before it, then the next shards."""
        if not self.units:
            return
        c = self.cursor
        r = next(i for i, (lo, hi) in enumerate(self.runs) if lo <= c < hi)
        lo, hi = self.runs[r]
        yield from range(c, hi)
        yield from range(lo, c)
        for k in range(1, len(self.runs)):
            lo, hi = self.runs[(r + k) % len(self.runs)]
            yield from range(lo, hi)

    def __iter__(self) -> Iterator[Unit]:
        self._start_renewal()
        while True:
            busy = False
            for p in self._order():
                u = self.units[p]
                if u.index in self.done or u.index in self.held:
                    continue
                got = self.claim(u.index)
                if got == "claimed":
                    self.cursor = p
                    yield u
                    break
                if got == "done":
                    self.done.add(u.index)
                else:
                    busy = True
            else:
                if not busy:
                    return  # every unit committed (or in this worker's hands)
                yield None  # "about to wait": the caller runs the units it holds first
                time.sleep(self.poll_s)  # others hold live claims: wait for commits or expiry

    # ---- ownership ------------------------------------------------------------------------------

    def still_mine(self, unit: int) -> bool:
        """True while the claim file is this worker's (checked right before publishing a part)."""
        if unit not in self.held:
            return False
        data = self._read(self.out.claim(unit))
        mine = data is not None and data.get("token") == self.token
        if not mine:
            with self._mu:
                self.lost.add(unit)
        return mine

    def _unlink_mine(self, unit: int) -> None:
        path = self.out.claim(unit)
        data = self._read(path)
        if data is not None and data.get("token") == self.token:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def release(self, unit: int, committed: bool = True) -> None:
        """Drop the claim (after its commit, or giving the unit back when ``committed`` is False)."""
        with self._mu:
            held = self.held.pop(unit, None)
        if held is not None:
            self._unlink_mine(unit)
        if committed:
            self.done.add(unit)

    def renew(self) -> None:
        """Touch every held claim that is still ours (the renewal thread calls this)."""
        with self._mu:
            units = list(self.held)
        for unit in units:
            path = self.out.claim(unit)
            data = self._read(path)
            if data is None or data.get("token") != self.token:
                with self._mu:
                    self.lost.add(unit)
                continue
            try:
                os.utime(path)
            except OSError:
                pass  # taken over between the read and the touch: still_mine will say so

    def _start_renewal(self) -> None:
        if self._thread is not None:
            return
        def loop():
            while not self._stop.wait(self.lease_s / 3):
                try:
                    self.renew()
                except Exception as e:  # noqa: BLE001 - a renewal error must not kill the worker
                    if self.log:
                        self.log(f"warning: could not renew unit claims: {e}")
        self._thread = threading.Thread(target=loop, name="batchrun-claims", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop renewing and give back every unit still held (not committed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for unit in list(self.held):
            try:
                self.release(unit, committed=False)
            except OSError:
                pass  # the lease expires on its own

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
