"""Unit claims on an object store: store/claims.py's protocol (same order, same waiting, same
take-over rules) with each claim a lease object (lease.py) instead of an O_EXCL file whose mtime
is renewed. A claim is taken with If-None-Match, renewed and released with If-Match; a stale
claim (store clock past Last-Modified + lease) or one of a dead earlier run of this worker (the
runner holds the worker's lock) is taken over with If-Match on the ETag that was read, so of any
number of takers one wins. A claim object is never half written (a PUT is atomic), so the local
protocol's grace for empty claim files has nothing to apply to.
"""
from __future__ import annotations

from batchrun.job.store.claims import UnitClaims
from batchrun.job.store.objects.lease import Held, Leases


class ObjectClaims(UnitClaims):
    def __init__(self, out, store, units, worker, **kw):
        self.store = store
        self.leases_held: dict[int, Held] = {}
        super().__init__(out, units, worker, **kw)
        self.leases = Leases(store, self.lease_s, self.owner)

    def _setup(self) -> None:
        pass  # keys need no directories

    def _committed(self, unit: int) -> bool:
        return self.store.stat(self.out.commit_marker(unit)) is not None

    def claim(self, unit: int) -> str:
        if self._committed(unit):
            return "done"
        held, _, took_over = self.leases.acquire(self.out.claim(unit), take_over=self._predecessor)
        if held is None:
            return "busy"
        if took_over:
            self.stolen += 1
        with self._mu:
            self.held[unit] = self.clock()
            self.leases_held[unit] = held
        if self._committed(unit):  # committed and released just before we claimed
            self.release(unit, committed=True)
            return "done"
        return "claimed"

    def still_mine(self, unit: int) -> bool:
        with self._mu:
            held = self.leases_held.get(unit)
        mine = held is not None and self.leases.mine(held)
        if not mine and unit in self.held:
            with self._mu:
                self.lost.add(unit)
        return mine

    def _unlink_mine(self, unit: int) -> None:
        with self._mu:
            held = self.leases_held.pop(unit, None)
        if held is not None:
            self.leases.release(held)

    def renew(self) -> None:
        with self._mu:
            held = list(self.leases_held.items())
        for unit, h in held:
            if not self.leases.renew(h):
                with self._mu:
                    self.lost.add(unit)
