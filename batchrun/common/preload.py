"""Import the engine side (torch, transformers, batchrun.engine) on a background thread
while `batchrun run` validates the job, digests the inputs and fingerprints it, so those seconds
overlap instead of adding up.

One daemon thread runs the queued steps in order (``start`` queues the imports, ``then`` more
steps such as loading the job's tokenizer). The main thread calls ``wait()`` before it needs any
of it (common/tokenizer.load_tokenizer, runner.load_engine, anything that imports torch): it blocks
until the steps queued so far ran, then raises the first step's error with its own type and
traceback, so a broken torch or tokenizer reads as it did without the preload. Nothing else in
the main thread imports torch meanwhile: two threads importing one package at once can see it
half initialised. Daemon: a job that fails its checks exits at once, not after the imports.
Without ``start`` (the Python API, tests) ``wait()`` does nothing; ``BATCHRUN_PRELOAD=0`` turns
it off (everything then imports on the main thread, when first needed, as before).
"""
from __future__ import annotations

import importlib
import os
import queue
import threading
import time

# "transformers", not its AutoTokenizer module: that module imports torch._dynamo and
# torch.distributed (~2-3 s), which a job of token-id prompts never needs; the queued tokenizer
# step (common/tokenizer.load_tokenizer, always through AutoTokenizer) imports it on this thread.
ENGINE_MODULES = ("torch", "transformers", "batchrun.engine.engine", "batchrun.engine.models.loader")

_steps: queue.Queue | None = None
_thread: threading.Thread | None = None
_cond = threading.Condition()
_queued = _done = 0
_error: BaseException | None = None
waited_s = 0.0  # how long the main thread blocked in wait() (the imports it could not overlap)


def _forget_in_forked_child() -> None:
    """fork copies only the calling thread: a child of a process that had started the preload
    has its queue and counters but no thread to run them, so its own start() would be skipped
    and its wait() would block forever (this hung the fork-based crash tests). Start over."""
    global _steps, _thread, _cond, _queued, _done, _error, waited_s
    _steps, _thread, _cond, _error = None, None, threading.Condition(), None
    _queued = _done = 0
    waited_s = 0.0


os.register_at_fork(after_in_child=_forget_in_forked_child)


def _worker() -> None:
    global _done, _error
    while True:
        step = _steps.get()
        try:
            if _error is None:  # after a failed step the later ones would only fail again
                step()
        except BaseException as e:  # handed to the main thread by wait()
            _error = e
        with _cond:
            _done += 1
            _cond.notify_all()


def then(step) -> None:
    """Queue ``step`` (no arguments) after the ones queued; nothing without ``start``."""
    global _queued
    if _steps is None:
        return
    with _cond:
        _queued += 1
    _steps.put(step)


def start(modules=ENGINE_MODULES) -> None:
    """Begin importing ``modules`` in the background (once per process)."""
    global _steps, _thread
    if _steps is not None or os.environ.get("BATCHRUN_PRELOAD", "1") == "0":
        return
    _steps = queue.Queue()
    _thread = threading.Thread(target=_worker, name="batchrun-preload", daemon=True)
    for name in modules:
        then(lambda name=name: importlib.import_module(name))
    _thread.start()


def busy() -> bool:
    """Steps are still running on the preload thread (an import may be half done)."""
    return _thread is not None and _thread.is_alive() and _done < _queued


def wait() -> None:
    """Block until every queued step ran; raise the first one's error. A no-op on the preload
    thread itself and when nothing was started."""
    global waited_s
    if _thread is None or threading.current_thread() is _thread:
        return
    t0 = time.perf_counter()
    with _cond:
        _cond.wait_for(lambda: _done >= _queued)
    waited_s += time.perf_counter() - t0
    if _error is not None:
        raise _error
