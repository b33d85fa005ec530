"""`lora-matrix --profile-kernels`: does a no-adapter decode step of the LoRA engine launch
exactly the kernels of the LoRA-disabled engine?

Through the engine's public API only: the kernels of one decode step (and its sampling) are
those of an eager `generate` with 2 output tokens (prefill + one decode step) less those of
one with 1 (prefill alone). Graph replays hide their kernels from the profiler, so both run
eagerly; a no-LoRA graph is captured from exactly this code path. On CPU the aten ops stand
in for kernels.
"""
from __future__ import annotations

import collections

from batchrun.bench.build import make_requests
from batchrun.bench.timing import eager, sync


def _kernels(engine, prompts: list[list[int]], output_len: int) -> collections.Counter:
    from torch.profiler import ProfilerActivity, profile
    cuda = engine.device.type == "cuda"
    reqs = make_requests(prompts, output_len, tag=f"probe{output_len}-")
    with eager(engine):
        engine.generate(reqs)  # untimed: allocator, lazy inits
        sync(engine)
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
            engine.generate(reqs)
            sync(engine)
    if cuda:
        return collections.Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def decode_step_kernels(engine, prompts: list[list[int]]) -> collections.Counter:
    """Kernel names launched by ONE eager decode step (with its sampling) of a no-adapter batch."""
    return _kernels(engine, prompts, 2) - _kernels(engine, prompts, 1)


def compare_decode_kernels(engine_a, engine_b, prompts) -> dict:
    ka = decode_step_kernels(engine_a, prompts)
    kb = decode_step_kernels(engine_b, prompts)

    def split(c):  # copies/fills are the step's input writes, compared separately
        core = collections.Counter({k: v for k, v in c.items()
                                    if "Memcpy" not in k and "Memset" not in k})
        return core, c - core
    core_a, copies_a = split(ka)
    core_b, copies_b = split(kb)
    extra, missing = core_b - core_a, core_a - core_b
    return {"device": engine_a.device.type, "kind": "cuda kernels" if engine_a.device.type ==
            "cuda" else "aten ops (cpu)",
            "passed": not extra and not missing and sum(core_a.values()) > 0,
            "num_kernels_A": sum(core_a.values()), "num_kernels_B": sum(core_b.values()),
            "extra_in_B": dict(extra), "missing_in_B": dict(missing),
            "copies_A": dict(copies_a), "copies_B": dict(copies_b),
            "kernels_A": dict(ka)}
