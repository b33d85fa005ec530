"""Stepping an engine by hand, for the diagnostics that time or compare single steps
(`lora_step_breakdown.py`, tests/gpu): a scheduler of its own, a batch prefilled up to its next
decode step, and the kernels of that one step. They reach into Scheduler and Sequence, which
the `batchrun bench` commands do not: those use the engine's public API only.

    from benchmarks.step_probe import decoding_batch   # with PYTHONPATH=. (the repo root)
"""
from __future__ import annotations

import contextlib
import time

import torch

from batchrun.bench.timing import eager, sync


@contextlib.contextmanager
def probe_scheduler(engine, prompts: list[list[int]], adapters: list[str | None] | None = None):
    """A scheduler of its own holding one request per prompt (row i runs adapters[i], None =
    base), for stepping the engine by hand; rows still running on exit are finished, which
    gives back their KV blocks and LoRA pins."""
    from batchrun.engine.config import SamplingParams
    from batchrun.engine.scheduler import Scheduler
    from batchrun.engine.sequence import Sequence
    sched = Scheduler(engine.config, engine.blocks, engine.lora)
    for i, ids in enumerate(prompts):
        sched.add(Sequence(i, f"probe{i}", ids, SamplingParams(max_tokens=4, ignore_eos=True),
                           adapters[i] if adapters else None, None))
    try:
        yield sched
    finally:
        for seq in list(sched.running):
            sched.finish(seq, "length")



def prefill_step_us(engine, prompts: list[list[int]], adapters: list[str | None] | None = None,
                    n: int = 8, warmup: int = 2) -> list[float]:
    """Wall µs of n engine.step calls (after `warmup` untimed ones), each prefilling every
    prompt in one step and sampling their first tokens, on a fresh probe scheduler each time
    (row i runs adapters[i])."""
    times = []
    for i in range(warmup + n):
        with probe_scheduler(engine, prompts, adapters) as sched:
            sync(engine)
            t0 = time.perf_counter()
            engine.step(sched)
            sync(engine)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e6)
            assert not sched.waiting, "prompts did not fit one prefill step"
    return times

@contextlib.contextmanager
def decoding_batch(engine, prompts: list[list[int]], adapters: list[str | None] | None = None,
                   graphs: bool = False):
    """Prefill `prompts` (row i runs adapters[i], None = base) and yield (runner, batch): a
    scheduled decode batch whose runner.decode(batch) is one decode step. The step may be repeated (it rewrites the
    same KV slot). Graphs are off unless graphs=True; KV blocks are given back afterwards."""
    with eager(engine, on=not graphs), probe_scheduler(engine, prompts, adapters) as sched:
        while sched.waiting or any(s.needs_prefill for s in sched.running):
            engine.step(sched)  # prefill (maybe in chunks) until every row is decoding
        batch = sched.schedule()
        assert not batch.is_prefill and len(batch.seqs) == len(prompts)
        yield engine.runner, batch


def decode_step_profile(engine, prompts: list[list[int]],
                        adapters: list[str | None] | None = None) -> list[tuple[str, float]]:
    """(kernel name, device µs) of every kernel of ONE eager decode step; row i runs
    adapters[i] (None = base). CPU: aten ops and their CPU time."""
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.device.type == "cuda"
    with decoding_batch(engine, prompts, adapters) as (runner, batch):
        runner.decode(batch)  # one untimed step: allocator, lazy inits
        sync(engine)
        acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=acts) as prof:
            runner.decode(batch)
            sync(engine)
    if cuda:
        return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]
    return [(e.name, e.cpu_time) for e in prof.events() if e.name.startswith("aten::")]


def graph_step_us(engine, prompts, adapters, n: int = 60) -> tuple[float, float]:
    """(median µs of runner.decode + sync, median µs of the bare graph replay + sync) of a
    graph decode step of `prompts` (row i runs adapters[i]); n timed calls after 5."""
    def med(fn):
        times = []
        for i in range(n + 5):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= 5:
                times.append((time.perf_counter() - t0) * 1e6)
        return sorted(times)[n // 2]
    with decoding_batch(engine, prompts, adapters, graphs=True) as (runner, batch):
        step = med(lambda: runner.decode(batch))
        _, key = runner.dispatch(len(batch.seqs), True, runner.decode_slot_bound(batch.seqs))
        replay = med(lambda: runner.graphs.replay(key))
    return step, replay
