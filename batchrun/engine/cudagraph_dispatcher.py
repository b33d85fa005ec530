"""The model runner's CUDA graphs: which one a step replays, and how they are captured.

One key type for every captured graph, `GraphKey(tokens, decode_only, lora_slots)`: the padded
token count; whether it is a full graph of a pure decode step (graphs.py) or the pieces of a
prefill step split at every attention call (prefill_graphs.py); and the LoRA slot bound of its
set (0: the no-LoRA set, whose graphs hold exactly the kernels of a LoRA-disabled engine; k > 0:
the set whose fused LoRA kernels stream the A rows of slots 0..k-1).

`dispatch()` is a pure function of the step and the captured sizes, tried in vLLM's order: a
full graph (a decode step of at most the largest captured batch), then piecewise graphs (a
prefill step of at most the largest captured token count, without decode rows or tokens still
on the device, and whose LoRA part is fused, as the pieces were captured), then eager.

`CudaGraphs.capture()` is the one capture path for both kinds: per kind, per LoRA set (no-LoRA
first, then slot bounds largest first: its GEMM outputs are the widest, later sets reuse its
memory), every size run once eagerly (Triton compiles, cuBLAS picks its kernels), then every
size captured largest first into the kind's one memory pool (smaller graphs reuse its blocks).
"""
from __future__ import annotations

import bisect
import enum
import time
from dataclasses import dataclass
from typing import Callable

import torch

from batchrun.engine.layers.step import LoRAStep


class Mode(enum.Enum):
    FULL = "full"  # replay a captured decode graph
    PIECEWISE = "piecewise"  # replay captured prefill pieces, the attention eager between them
    EAGER = "eager"


@dataclass(frozen=True)
class GraphKey:
    tokens: int  # padded token count (a decode step: its batch size)
    decode_only: bool  # True: a full decode graph; False: piecewise prefill graphs
    lora_slots: int  # 0: the no-LoRA set; k > 0: the LoRA set of slot bound k

    @property
    def has_lora(self) -> bool:
        return self.lora_slots > 0


@dataclass(frozen=True)
class CaptureSizes:
    decode: tuple[int, ...] = ()  # batch sizes of the full decode graphs, ascending
    prefill: tuple[int, ...] = ()  # padded token counts of the piecewise prefill graphs, ascending


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, then every 8 up to max_num_seqs (and
    max_num_seqs itself, so no batch the scheduler can form runs eagerly). Sorted ascending."""
    if sizes is None:
        sizes = [1, 2, 4] + list(range(8, max_num_seqs + 1, 8))
        sizes.append(max_num_seqs)
    sizes = sorted({s for s in sizes if 1 <= s <= max_num_seqs})
    if not sizes:
        raise ValueError(f"no CUDA graph size is within 1..max_num_seqs={max_num_seqs}")
    return sizes


def token_buckets(max_tokens: int) -> list[int]:
    """Padded prefill token counts to capture: 16, 32, 64, then every 64 up to max_tokens (and
    max_tokens itself). At these sizes a 7b layer's GEMMs stream their weights, so padding up
    to 63 tokens costs little."""
    if max_tokens < 1:
        return []
    sizes = {16, 32} | set(range(64, max_tokens + 1, 64)) | {max_tokens}
    return sorted(s for s in sizes if s <= max_tokens)


def _padded(sizes: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def dispatch(num_tokens: int, decode_only: bool, lora_slots: int, sizes: CaptureSizes, *,
             fused: bool = True, piecewise: bool = True) -> tuple[Mode, GraphKey | None]:
    """(mode, key) for a step of `num_tokens` tokens and slot bound `lora_slots` (0: no adapter
    token); key is None when the step runs eagerly. decode_only: a pure decode step.
    fused: the step's LoRA part would be fused (piecewise LoRA sets are captured fused).
    piecewise: the step may replay prefill pieces (False: it has decode rows or tokens still
    on the device, which the static prefill inputs do not carry)."""
    if num_tokens < 1:
        raise ValueError(f"a step has >= 1 token, got {num_tokens}")
    if lora_slots < 0:
        raise ValueError(f"lora_slots must be >= 0, got {lora_slots}")
    if decode_only:
        padded = _padded(sizes.decode, num_tokens)
        if padded is not None:
            return Mode.FULL, GraphKey(padded, True, lora_slots)
        return Mode.EAGER, None
    if piecewise and (lora_slots == 0 or fused):
        padded = _padded(sizes.prefill, num_tokens)
        if padded is not None:
            return Mode.PIECEWISE, GraphKey(padded, False, lora_slots)
    return Mode.EAGER, None


def capture_sets(with_lora: bool, lora: dict[int, LoRAStep] | None) -> list[tuple[int, LoRAStep | None]]:
    """(slot bound, LoRAStep) of each set to capture, in capture order: the no-LoRA set, then,
    with_lora, each of `lora`'s steps (slot bound -> the step whose num_slots it is; their
    tensors must stay allocated: the graphs read them), the largest bound first."""
    if with_lora != bool(lora):
        raise ValueError(f"capturing with_lora={with_lora} needs "
                         f"{'LoRA steps' if with_lora else 'no LoRA step'}")
    if lora and any(k != step.num_slots or k < 1 for k, step in lora.items()):
        raise ValueError(f"LoRA steps must be keyed by their slot bound, got "
                         f"{ {k: s.num_slots for k, s in lora.items()} }")
    return [(0, None)] + [(k, lora[k]) for k in sorted(lora or {}, reverse=True)]


# forward(size, lora_step) of one kind: what a graph of that size and set captures
Forward = Callable[[int, LoRAStep | None], torch.Tensor]


class CudaGraphs:
    """A model runner's captured graphs of both kinds, its dispatch and replay.

    decode: graphs.DecodeGraphs or None; prefill: prefill_graphs.PrefillGraphs or None (each
    with `sizes`, `decode_only`, `pool`, `warm_up`, `capture_one`, `replay`, `record_stats`,
    `stats` and `failure_hint`, what to tell the user when its capture fails, or None). with_lora: LoRA sets are
    captured too (a step with an adapter token on an engine without them is a bug)."""

    def __init__(self, with_lora: bool, decode=None, prefill=None):
        self.with_lora, self.decode, self.prefill = with_lora, decode, prefill
        self.sizes = CaptureSizes(tuple(decode.sizes) if decode is not None else (),
                                  tuple(prefill.sizes) if prefill is not None else ())

    def dispatch(self, num_tokens: int, decode_only: bool, lora_slots: int, *, fused: bool = True,
                 piecewise: bool = True) -> tuple[Mode, GraphKey | None]:
        if lora_slots and not self.with_lora:
            raise AssertionError("a LoRA row reached an engine without LoRA")
        return dispatch(num_tokens, decode_only, lora_slots, self.sizes, fused=fused,
                        piecewise=piecewise)

    def replay(self, key: GraphKey, meta=None) -> torch.Tensor:
        """The output of the graph(s) of `key` over the static inputs the runner wrote; a
        piecewise replay runs each attention eagerly on `meta`, the step's attention metadata."""
        if key.decode_only:
            return self.decode.replay(key)
        return self.prefill.replay(key, meta)

    @torch.inference_mode()
    def capture(self, forwards: dict[bool, tuple[Forward, dict[int, LoRAStep] | None]]) -> None:
        """Capture every kind this holds: forwards[decode_only] = (forward, LoRA steps by slot
        bound). The caller has set the static inputs to padding (scratch block, slot -1)."""
        for graphs in (self.decode, self.prefill):
            if graphs is None:
                continue
            forward, lora = forwards[graphs.decode_only]
            sets = capture_sets(self.with_lora, lora)
            try:
                self._capture_kind(graphs, forward, sets)
            except Exception as e:
                if graphs.failure_hint is None:
                    raise
                raise RuntimeError(f"{graphs.failure_hint}: {e}") from e

    @staticmethod
    def _capture_kind(graphs, forward: Forward, sets: list[tuple[int, LoRAStep | None]]) -> None:
        t0 = time.perf_counter()
        graphs.pool = torch.cuda.graph_pool_handle()
        pool_bytes = {}
        for slots, step_lora in sets:
            for size in reversed(graphs.sizes):
                graphs.warm_up(forward, size, step_lora)
            # torch.cuda.graph() empties the allocator cache on entry; do it first so the
            # difference below is only what this set's captures add to the pool
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved()
            for size in reversed(graphs.sizes):
                graphs.capture_one(forward, GraphKey(size, graphs.decode_only, slots), step_lora)
            torch.cuda.synchronize()
            pool_bytes[f"lora_{slots}" if slots else "no_lora"] = torch.cuda.memory_reserved() - before
        graphs.record_stats(time.perf_counter() - t0, [s for s, _ in sets], pool_bytes)
