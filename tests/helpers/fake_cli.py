"""The `batchrun` CLI with the FakeEngine swapped in, plus crash points for the kill tests.

    install(crash_at="before_rename:N")  die (os._exit(137), as abrupt as kill -9) after writing
                                         the N-th unit's temp file, before renaming it
    install(crash_at="after_rename:N")   ... after renaming it into the dataset, before its commit
    install(crash_at="after_commit:N")   ... after the N-th commit marker
    install(crash_at="os.remove:N")      die right before the N-th call of os.remove (also
                                         os.unlink, os.replace, os.rename, shutil.rmtree): a
                                         kill -9 at a chosen system call, as strace's inject does
On an object-store output (store/objects/, nothing is renamed):
    install(crash_at="before_put:N")     die before the N-th part file's PUT (its bytes built)
    install(crash_at="after_put:N")      ... after the part's PUT, before its commit marker
    install(crash_at="after_commit:N")   ... after the N-th commit marker (as locally)
    install(crash_at="store.put:N")      die right before the N-th call of that kind (put, get,
                                         delete, delete_many) on the object store, S3 or GCS:
                                         claims, leases, plan, manifest, metrics ("s3.put:N" is
                                         the same point under its first name)
N counts calls/units of this process (1-based). Run as a script (``python tests/helpers/fake_cli.py
ARGS``, as run_cli and --workers children do) it reads CRASH_AT from the environment.
"""
import os
import sys

if __name__ == "__main__":  # a script's sys.path starts at its own folder: put the repository first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import batchrun.job.store.commit as commit  # noqa: E402
import batchrun.job.run.runner as runner  # noqa: E402
import batchrun.job.launch.workers as workers  # noqa: E402
from tests.helpers.fake_engine import FakeEngine  # noqa: E402


def install(crash_at: str = "") -> None:
    runner.load_engine = FakeEngine.from_spec
    workers.worker_command = lambda: [sys.executable, os.path.abspath(__file__)]  # --workers children: fake too
    point, _, count = crash_at.partition(":")
    if not point:
        return
    n = int(count)
    if point.startswith(("s3.", "store.")):
        _crash_at_store_call(point.split(".", 1)[1], n)
        return
    if "." in point:
        _crash_at_call(point, n)
        return
    if point in ("before_put", "after_put", "after_commit"):
        _crash_at_object_step(point, n)
    if point in ("before_put", "after_put"):
        return
    seen = {"before_rename": 0, "after_rename": 0, "after_commit": 0}
    orig_publish, orig_record = commit.publish_part, commit.record_commit

    def publish(out, unit, tmp):
        seen["before_rename"] += 1
        if point == "before_rename" and seen["before_rename"] == n:
            os._exit(137)
        final = orig_publish(out, unit, tmp)
        seen["after_rename"] += 1
        if point == "after_rename" and seen["after_rename"] == n:
            os._exit(137)
        return final

    def record(out, unit, info):
        orig_record(out, unit, info)
        seen["after_commit"] += 1
        if point == "after_commit" and seen["after_commit"] == n:
            os._exit(137)

    commit.publish_part, commit.record_commit = publish, record


def _crash_at_object_step(point: str, n: int) -> None:
    import batchrun.job.store.objects.commit as objcommit
    seen = {"before_put": 0, "after_put": 0, "after_commit": 0}
    orig_publish, orig_record = objcommit.publish_part, objcommit.record_commit

    def publish(out, store, unit, part):
        seen["before_put"] += 1
        if point == "before_put" and seen["before_put"] == n:
            os._exit(137)
        etag = orig_publish(out, store, unit, part)
        seen["after_put"] += 1
        if point == "after_put" and seen["after_put"] == n:
            os._exit(137)
        return etag

    def record(out, store, unit, info):
        orig_record(out, store, unit, info)
        seen["after_commit"] += 1
        if point == "after_commit" and seen["after_commit"] == n:
            os._exit(137)

    objcommit.publish_part, objcommit.record_commit = publish, record


def _crash_at_store_call(name: str, n: int) -> None:
    """Count calls of ``name`` on whichever object store the run uses (one count for both kinds)."""
    from batchrun.job.storage.gcs import GcsStorage
    from batchrun.job.storage.s3 import S3Storage
    calls = [0]
    for cls in (S3Storage, GcsStorage):
        orig = getattr(cls, name)

        def wrapped(self, *a, _orig=orig, **kw):
            calls[0] += 1
            if calls[0] == n:
                os._exit(137)
            return _orig(self, *a, **kw)

        setattr(cls, name, wrapped)


def _crash_at_call(point: str, n: int) -> None:
    import shutil
    module, name = point.split(".")
    target = {"os": os, "shutil": shutil}[module]
    orig, calls = getattr(target, name), [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == n:
            os._exit(137)
        return orig(*a, **kw)

    setattr(target, name, wrapped)


def cli(args: list[str], crash_at: str = "", env: dict | None = None) -> None:
    """Child-process entry: patch, then run the CLI the way the console script does (signal
    handlers first), exiting with its exit code."""
    os.environ.update(env or {})
    FakeEngine.results_emitted = 0  # a forked child inherits the parent's count
    install(crash_at)
    from batchrun.__main__ import entry
    entry(args)


if __name__ == "__main__":
    cli(sys.argv[1:], os.environ.get("CRASH_AT", ""))
