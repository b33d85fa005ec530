"""The two signal phases of job/run/interrupt.py: at once (os._exit 130) while the console entry's
start-up has written nothing, then Interrupted; and a signal whose Interrupted Python swallowed
(inside a weakref callback, as importlib's module-lock callback is) is not lost."""
import os
import signal
import subprocess
import sys
import textwrap
import weakref

import pytest

from batchrun.job.run import interrupt
from batchrun.job.run.interrupt import Interrupted, Signals
from batchrun.job.plan.prepare import prepare
from batchrun.job.jobfile.spec import load_job
from tests.helpers.jobs import demo_rows, REPO

# A signal that lands inside a weakref callback: the handler runs at the first call after kill.
SIGNAL_IN_WEAKREF_CALLBACK = """
import os, signal, sys, time, weakref
from batchrun.job.run import interrupt
interrupt.install_early()
{after_install}
class Obj: pass
obj = Obj()
def callback(ref):
    os.kill(os.getpid(), signal.SIG{sig})
    len("the handler runs after this call")
keep = weakref.ref(obj, callback)
del obj
time.sleep(0.2)
print("still running")
"""


def _run(code: str):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.parametrize("sig", ["TERM", "INT"])
def test_start_up_signal_inside_a_weakref_callback_exits_130_at_once(sig):
    proc = _run(SIGNAL_IN_WEAKREF_CALLBACK.format(after_install="", sig=sig))
    assert proc.returncode == 130, proc.stderr
    assert "still running" not in proc.stdout
    assert proc.stderr.splitlines() == [interrupt.message(f"SIG{sig}").rstrip("\n")]


def test_why_start_up_does_not_raise_python_swallows_it_in_a_weakref_callback():
    """The premise of the start-up phase: raised from the handler there, Interrupted is printed as
    "Exception ignored" and the process goes on (with importlib's lock callback, holding the import
    lock: the CI hang)."""
    proc = _run(SIGNAL_IN_WEAKREF_CALLBACK.format(after_install="interrupt.start_up_over()", sig="TERM"))
    assert proc.returncode == 0 and "still running" in proc.stdout, proc.stderr
    assert "Exception ignored" in proc.stderr and "Interrupted" in proc.stderr


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed one
def test_a_swallowed_interrupt_is_raised_again_by_check():
    signals = Signals()
    signals.install()
    try:
        class Obj:
            pass
        obj = Obj()

        def callback(ref):
            os.kill(os.getpid(), signal.SIGTERM)
            len("the handler runs after this call")
        keep = weakref.ref(obj, callback)  # noqa: F841
        del obj  # the Interrupted raised in the callback is swallowed ("Exception ignored")
        with pytest.raises(Interrupted, match="SIGTERM"):
            signals.check()
    finally:
        signals.restore()


def test_start_up_over_leaves_other_handlers_alone():
    """The Python API and in-process runs never installed the start-up handler: nothing changes."""
    before = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    interrupt.start_up_over()
    assert {s: signal.getsignal(s) for s in interrupt.SIGNALS} == before


def test_prepare_ends_start_up_before_its_first_write(make_job, tmp_path, monkeypatch):
    job = make_job(demo_rows(6))
    spec = load_job(job)
    before = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    seen = []
    real = interrupt.start_up_over

    def spy():
        seen.append(os.path.exists(tmp_path / "out"))  # nothing written yet
        real()
    monkeypatch.setattr("batchrun.job.plan.prepare.start_up_over", spy)
    try:
        interrupt.install_early()
        assert interrupt.in_start_up()
        assert signal.getsignal(signal.SIGTERM) is interrupt._exit_now
        prepare(spec)
        assert seen == [False]
        assert not interrupt.in_start_up()
        assert all(signal.getsignal(s) is interrupt._raise for s in interrupt.SIGNALS)
        assert (tmp_path / "out").exists()
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        monkeypatch.setattr(interrupt, "_start_up", False)
