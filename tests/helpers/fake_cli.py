"""The `batchrun` CLI with the FakeEngine swapped in, plus crash points for the kill tests.

    install(crash_at="before_rename:N")  die (os._exit(137), as abrupt as kill -9) after writing
                                         the N-th unit's temp file, before renaming it
    install(crash_at="after_rename:N")   ... after renaming it into the dataset, before its commit
    install(crash_at="after_commit:N")   ... after the N-th commit marker
    install(crash_at="os.remove:N")      die right before the N-th call of os.remove (also
                                         os.unlink, os.replace, os.rename, shutil.rmtree): a
                                         kill -9 at a chosen system call, as strace's inject does
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
    if "." in point:
        _crash_at_call(point, n)
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
