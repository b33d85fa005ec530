"""UnitClaims (batchrun/job/store/claims.py): claim, skip committed, renew, expire/steal, racing stealers,
still_mine, release, shard-preferring order, waiting for other workers' claims."""
import json
import multiprocessing
import os
import threading
import time

import pytest

from batchrun.job.store import claims as claims_mod
from batchrun.job.store.claims import UnitClaims, lease_from_env
from batchrun.job.store.layout import OutputDir
from batchrun.job.plan.units import Unit


def units(shards=((None, 4), ("reverse", 2), ("upper", 2))) -> list[Unit]:
    out, start = [], 0
    for adapter, n in shards:
        for _ in range(n):
            out.append(Unit(len(out), adapter, True, start, 10))
            start += 10
    return out


def commit(out: OutputDir, unit: int) -> None:
    os.makedirs(out.commits, exist_ok=True)
    with open(out.commit_marker(unit), "w") as f:
        json.dump({"unit": unit, "rows": 10}, f)


def age(path: str, seconds: float) -> None:
    """Make a claim look as if its owner stopped renewing it ``seconds`` ago."""
    t = time.time() - seconds
    os.utime(path, (t, t))


@pytest.fixture
def out(tmp_path) -> OutputDir:
    return OutputDir(str(tmp_path / "out"))


def test_claim_file_is_exclusive_and_names_its_owner(out):
    a = UnitClaims(out, units(), "0", lease_s=30)
    b = UnitClaims(out, units(), "1", lease_s=30)
    assert a.claim(3) == "claimed"
    assert b.claim(3) == "busy"
    data = json.loads(open(out.claim(3)).read())
    assert data["worker"] == "0" and data["pid"] == os.getpid() and data["lease_s"] == 30
    assert data["token"] == a.token != b.token
    assert a.still_mine(3) and not b.still_mine(3)
    a.release(3)
    assert not os.path.exists(out.claim(3)) and not a.still_mine(3)


def test_committed_units_are_skipped_and_claims_released(out):
    commit(out, 0)
    commit(out, 5)
    c = UnitClaims(out, units(), "0", lease_s=30, done={2})
    got = []
    for u in c:
        assert u is not None
        got.append(u.index)
        commit(out, u.index)
        c.release(u.index)
    c.close()
    assert got == [1, 3, 4, 6, 7]
    assert os.listdir(out.claims) == []


def test_order_prefers_the_current_shard_then_the_next_ones(out):
    c = UnitClaims(out, units(), "0", lease_s=30, start=2)
    got = []
    for u in c:
        got.append(u.index)
        commit(out, u.index)
        c.release(u.index)
    assert got == [2, 3, 0, 1, 4, 5, 6, 7]
    c2 = UnitClaims(OutputDir(out.path + "2"), units(), "0", lease_s=30, start=5)
    got = []
    for u in c2:
        got.append(u.index)
        c2.release(u.index, committed=True)
    assert got == [5, 4, 6, 7, 0, 1, 2, 3]


def test_a_claim_committed_between_check_and_create_is_given_back(out, monkeypatch):
    c = UnitClaims(out, units(), "0", lease_s=30)
    real_create = c._create

    def create_then_someone_commits(path):
        ok = real_create(path)
        commit(out, 1)  # another worker committed unit 1 and released its claim just before
        return ok

    monkeypatch.setattr(c, "_create", create_then_someone_commits)
    assert c.claim(1) == "done"
    assert not os.path.exists(out.claim(1)) and 1 not in c.held


def test_renewal_keeps_a_claim_alive(out):
    a = UnitClaims(out, units(), "0", lease_s=0.6)
    it = iter(a)  # starts the renewal thread (every lease/3 = 0.2 s)
    first = next(it)
    assert first.index == 0
    time.sleep(1.0)  # longer than the lease: only the renewals keep it
    b = UnitClaims(out, units(), "1", lease_s=0.6)
    assert b.claim(0) == "busy"
    a.close()  # stops renewing and gives the unit back
    assert not os.path.exists(out.claim(0))
    assert b.claim(0) == "claimed"


def test_an_expired_claim_is_taken_over_and_the_old_owner_sees_it(out):
    a = UnitClaims(out, units(), "0", lease_s=5)
    b = UnitClaims(out, units(), "1", lease_s=5)
    assert a.claim(4) == "claimed"
    age(out.claim(4), 4)
    assert b.claim(4) == "busy"  # not expired yet
    age(out.claim(4), 6)
    assert b.claim(4) == "claimed" and b.stolen == 1
    assert b.still_mine(4)
    assert not a.still_mine(4) and 4 in a.lost  # the late finisher discards its result
    a.renew()  # renewing a lost claim does not touch the new owner's file
    a.release(4, committed=False)  # nor does giving it back
    assert json.loads(open(out.claim(4)).read())["token"] == b.token
    assert [n for n in os.listdir(out.claims)] == ["unit-000004"]  # no stale-* leftovers



def test_a_claim_file_without_an_owner_is_stale_after_a_short_grace(out):
    # Its creator died between O_CREAT and writing the owner (kill -9 there): nobody renews it,
    # so it is taken over after UNREADABLE_GRACE_S, not after the whole lease (the rerun of a
    # killed job used to sit out the 120 s default).
    b = UnitClaims(out, units(), "0", lease_s=120)
    os.makedirs(out.claims, exist_ok=True)
    open(out.claim(4), "w").close()  # created, never written
    assert b.claim(4) == "busy"  # a live creator may be writing it right now
    age(out.claim(4), claims_mod.UNREADABLE_GRACE_S - 1)
    assert b.claim(4) == "busy"
    age(out.claim(4), claims_mod.UNREADABLE_GRACE_S + 1)
    assert b.claim(4) == "claimed" and b.stolen == 1
    assert json.loads(open(out.claim(4)).read())["token"] == b.token
    with open(out.claim(5), "w") as f:
        f.write('{"worker": "1", "tok')  # torn owner: unreadable too
    age(out.claim(5), claims_mod.UNREADABLE_GRACE_S + 1)
    assert b.claim(5) == "claimed"
    c = UnitClaims(out, units(), "1", lease_s=120)
    assert c.claim(6) == "claimed"
    age(out.claim(6), claims_mod.UNREADABLE_GRACE_S + 1)
    assert b.claim(6) == "busy"  # a readable owner keeps its whole lease

def test_a_claim_renewed_while_being_stolen_is_put_back(out, monkeypatch):
    a = UnitClaims(out, units(), "0", lease_s=5)
    b = UnitClaims(out, units(), "1", lease_s=5)
    assert a.claim(2) == "claimed"
    age(out.claim(2), 10)
    real_rename = os.rename

    def owner_renews_first(src, dst):  # the owner's renewal lands between b's look and b's rename
        os.utime(src)
        real_rename(src, dst)

    monkeypatch.setattr(claims_mod.os, "rename", owner_renews_first)
    assert b.claim(2) == "busy"
    assert a.still_mine(2) and not b.still_mine(2)
    assert os.listdir(out.claims) == ["unit-000002"]


def _steal(path: str, barrier, results, worker: int) -> None:
    c = UnitClaims(OutputDir(path), units(), str(worker), lease_s=5)
    barrier.wait()
    got = c.claim(6)
    results.put((worker, got, c.token))
    c._stop.set()


def test_a_stealer_that_looked_before_another_took_over_does_not_make_two_winners(out, monkeypatch):
    """The interleaving CI once hit with six racing processes, forced: stealer b looks at the
    expired claim; a takes it over meanwhile; b then moves a's fresh claim aside, and c, finding
    the name free, claims it while b tries to put a's back. Stealers take turns, so a must wait
    for b's look to end and sees b's claim."""
    dead = UnitClaims(out, units(), "dead", lease_s=5)
    assert dead.claim(6) == "claimed"
    age(out.claim(6), 60)
    a, b, c = (UnitClaims(out, units(), w, lease_s=5) for w in "abc")
    got: dict[str, str] = {}
    real_stat, real_link = os.stat, os.link
    hooked = threading.Event()

    def b_looks(path, *args, **kw):
        if threading.current_thread() is main and path == out.claim(6) and not hooked.is_set():
            hooked.set()  # b has looked: let a try its whole take-over now (1 s)
            st = real_stat(path, *args, **kw)
            t = threading.Thread(target=lambda: got.__setitem__("a", a.claim(6)))
            t.start()
            t.join(1.0)
            threads.append(t)
            return st
        return real_stat(path, *args, **kw)

    def b_puts_back(src, dst, *args, **kw):
        got["c"] = c.claim(6)  # c finds the name free while b puts a's claim back
        return real_link(src, dst, *args, **kw)

    main, threads = threading.current_thread(), []
    monkeypatch.setattr(claims_mod.os, "stat", b_looks)
    monkeypatch.setattr(claims_mod.os, "link", b_puts_back)
    got["b"] = b.claim(6)
    for t in threads:
        t.join(10)
    monkeypatch.undo()
    got.setdefault("c", c.claim(6))
    winners = [w for w, g in got.items() if g == "claimed"]
    assert len(winners) == 1, got
    owner = {"a": a, "b": b, "c": c}[winners[0]]
    assert json.loads(open(out.claim(6)).read())["token"] == owner.token
    assert os.listdir(out.claims) == ["unit-000006"]
    for x in (a, b, c, dead):
        x._stop.set()


@pytest.mark.parametrize("round_", range(5))
def test_two_or_more_stealers_racing_for_one_expired_claim_one_wins(out, round_):
    dead = UnitClaims(out, units(), "dead", lease_s=5)
    assert dead.claim(6) == "claimed"
    age(out.claim(6), 60)
    ctx = multiprocessing.get_context("fork")
    n = 6
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_steal, args=(out.path, barrier, results, w)) for w in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(30)
    winners = [(w, tok) for w, g, tok in got if g == "claimed"]
    assert len(winners) == 1, got
    assert json.loads(open(out.claim(6)).read())["token"] == winners[0][1]
    assert not dead.still_mine(6)
    assert os.listdir(out.claims) == ["unit-000006"]


def test_waits_for_live_claims_of_others_and_takes_over_expired_ones(out):
    us = units(((None, 2),))
    a = UnitClaims(out, us, "0", lease_s=0.5)
    assert a.claim(0) == "claimed" and a.claim(1) == "claimed"  # a never renews (no thread): it "died"
    b = UnitClaims(out, us, "1", lease_s=0.5, poll_s=0.05)
    t0 = time.time()
    got = []
    for u in b:
        if u is None:  # b is about to wait: nothing claimable yet
            got.append(None)
            continue
        got.append(u.index)
        commit(out, u.index)
        b.release(u.index)
    assert got[0] is None and [g for g in got if g is not None] == [0, 1]
    assert time.time() - t0 >= 0.4 and b.stolen == 2
    b.close()


def test_a_worker_waits_while_another_commits(out):
    us = units(((None, 1),))
    a = UnitClaims(out, us, "0", lease_s=30)
    assert a.claim(0) == "claimed"
    b = UnitClaims(out, us, "1", lease_s=30, poll_s=0.02)
    it = iter(b)
    assert next(it) is None
    commit(out, 0)
    a.release(0)
    assert list(it) == []  # committed by a: b ends without running it


def test_close_gives_back_units_not_committed(out):
    a = UnitClaims(out, units(), "0", lease_s=30)
    it = iter(a)
    assert [next(it).index, next(it).index] == [0, 1]
    a.close()
    assert os.listdir(out.claims) == []
    assert UnitClaims(out, units(), "1", lease_s=30).claim(0) == "claimed"


def test_lease_setting(monkeypatch):
    monkeypatch.delenv("BATCHRUN_CLAIM_LEASE", raising=False)
    assert lease_from_env() == 120.0
    assert lease_from_env(2.5) == 2.5
    monkeypatch.setenv("BATCHRUN_CLAIM_LEASE", "0.5")
    assert lease_from_env() == 0.5
    monkeypatch.setenv("BATCHRUN_CLAIM_LEASE", "soon")
    with pytest.raises(ValueError, match="BATCHRUN_CLAIM_LEASE='soon' is not a number"):
        lease_from_env()
    with pytest.raises(ValueError, match="positive number of seconds"):
        lease_from_env(0.0)


def test_a_claim_of_a_dead_earlier_run_of_the_same_worker_is_taken_over_at_once(out):
    dead = UnitClaims(out, units(), "0", lease_s=30)  # killed: its claims stay, lease not expired
    assert dead.claim(1) == "claimed"
    other = UnitClaims(out, units(), "1", lease_s=30)
    assert other.claim(1) == "busy"
    rerun = UnitClaims(out, units(), "0", lease_s=30)  # same worker name: holds that worker's lock
    assert rerun.claim(1) == "claimed" and rerun.stolen == 1
    assert not dead.still_mine(1)


def test_a_full_disk_while_claiming_is_an_output_io_error(out, monkeypatch):
    # the feeder thread claims ahead of the engine: a claim that cannot be written must end the
    # run as the output I/O failure it is (exit 7, one line with the fix), not an internal error
    import errno

    from batchrun.errors import OutputIOError

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(claims_mod.os, "write", full)
    c = UnitClaims(out, units(), "0", lease_s=30)
    with pytest.raises(OutputIOError, match="No space left on device. free some space"):
        c.claim(0)
    monkeypatch.undo()
    assert not [n for n in os.listdir(out.claims) if n.startswith("unit-")]  # no empty claim left
