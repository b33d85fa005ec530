"""Piecewise CUDA graphs for small prefill steps (vLLM's piecewise capture, by hand).

A prefill step of a few hundred tokens runs ~6 ms of kernels on a 7b model but launches ~300
of them from Python, so eagerly it takes 12-21 ms of host time (docs/benchmarks.md). Its
attention cannot sit in a graph as is: the varlen kernel's grid and the sequences' lengths
come from the host each step. So the forward is captured in pieces, split at every attention
call: piece 0 is the embedding and layer 0 up to its rotary (which writes the step's K/V into
the paged cache), piece i is layer i-1's o_proj up to layer i's rotary, the last piece ends
with the final norm. A replay runs piece 0, layer 0's attention eagerly (the step's real
metadata, into one static output buffer the next piece reads), piece 1, ... : 33 graph
launches and 32 attention launches on a 32-layer model instead of ~300 launches.

Pieces are captured per padded token count (`token_buckets`) and, on a LoRA engine, once more
per slot bound (the LoRA kernels read each token's slot from the runner's static buffer, as
fused decode graphs do). Padding tokens write their K/V into the scratch block and belong to
no sequence, so the attention leaves their rows alone; their rows carry garbage through the
row-wise layers and are never read.

A PrefillGraphs belongs to one ModelRunner (model_runner.py), which fills the static inputs,
captures through the forward function it gives and replays.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from batchrun.engine.layers.attention import AttnMetadata, PagedAttention
from batchrun.engine.layers.step import LoRAStep


@dataclass(frozen=True)
class PrefillKey:
    tokens: int  # the padded token count the pieces were captured for
    lora_slots: int  # 0: no adapter token; k > 0: the LoRA set of slot bound k


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts to capture: 16, 32, 64, then every 64 up to max_tokens (and
    max_tokens itself). At these sizes a 7b layer's GEMMs stream their weights, so padding up
    to 63 tokens costs little."""
    if max_tokens < 1:
        return []
    sizes = {16, 32} | set(range(64, max_tokens + 1, 64)) | {max_tokens}
    return sorted(s for s in sizes if s <= max_tokens)


@dataclass
class _Pieces:
    """One captured forward: graphs[i] runs before attention layer i (the last one after all
    of them); hidden is the forward's output."""
    graphs: list = field(default_factory=list)
    hidden: torch.Tensor | None = None


class _Split:
    """Installed as every PagedAttention's `split` while a piecewise forward runs: the piece
    so far ends by copying q into the static query buffer, and the rest of the forward reads
    the static attention output. capture=True: ends the current graph there and starts the
    next; else, with `meta`, runs the attention eagerly on it (the replay, without graphs:
    CPU tests); else (warm-up) leaves the output as it is."""

    def __init__(self, pieces: _Pieces, q: torch.Tensor, out: torch.Tensor, pool, capture: bool,
                 meta: AttnMetadata | None = None):
        self.pieces, self.q, self.out, self.pool = pieces, q, out, pool
        self.capture, self.meta, self.calls = capture, meta, 0

    def __call__(self, attn: PagedAttention, q, k, v, _meta: AttnMetadata) -> torch.Tensor:
        if k is not None:
            raise AssertionError("piecewise prefill needs the rotary kernel to write the K/V "
                                 "(the Triton path)")
        rows = q.shape[0]
        q_static, out = self.q[:rows], self.out[:rows]
        q_static.copy_(q)  # one buffer for every layer: the pool keeps no per-layer q
        self.calls += 1
        if self.capture:
            self.pieces.graphs[-1].capture_end()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            self.pieces.graphs.append(graph)
        elif self.meta is not None:
            attn.attend(q_static, None, None, self.meta, out=out)
        return out


class PrefillGraphs:
    def __init__(self, max_tokens: int, with_lora: bool, attention: list[PagedAttention],
                 q: torch.Tensor, out: torch.Tensor):
        # q, out: the static query and attention output buffers, [>= max_tokens, Hq, D] each,
        # shared by every layer and size
        self.sizes = token_buckets(max_tokens)
        if not self.sizes:
            raise ValueError(f"prefill graphs need max_tokens >= 1, got {max_tokens}")
        self.with_lora, self.attention, self.q, self.out = with_lora, attention, q, out
        self.pieces: dict[PrefillKey, _Pieces] = {}
        self.pool = None
        self.stats: dict = {}
        self.replays = 0  # steps replayed (benchmarks and tests read it)

    def dispatch(self, tokens: int, lora_slots: int) -> PrefillKey | None:
        """The pieces for a prefill step of `tokens` tokens and slot bound `lora_slots`; None:
        run it eagerly (more tokens than any captured size)."""
        if tokens < 1:
            raise ValueError(f"a prefill step has >= 1 token, got {tokens}")
        if lora_slots and not self.with_lora:
            raise AssertionError("a LoRA row reached an engine without LoRA")
        size = next((s for s in self.sizes if s >= tokens), None)
        return None if size is None else PrefillKey(size, lora_slots)

    def replay(self, key: PrefillKey, meta: AttnMetadata) -> torch.Tensor:
        """Run the step whose inputs the runner has written: [key.tokens, H] hidden states
        (rows past the step's tokens are padding)."""
        pieces = self.pieces[key]
        self.replays += 1
        q, out = self.q[:key.tokens], self.out[:key.tokens]
        for graph, attn in zip(pieces.graphs, self.attention):
            graph.replay()
            attn.attend(q, None, None, meta, out=out)
        pieces.graphs[-1].replay()
        return pieces.hidden

    def run_eager(self, forward: Callable[[int, LoRAStep | None], torch.Tensor], key: PrefillKey,
                  meta: AttnMetadata, step_lora: LoRAStep | None) -> torch.Tensor:
        """What replay(key, meta) computes, without graphs: the same padded forward over the
        static inputs, split the same way, each attention run on `meta` (CPU tests)."""
        try:
            return self._run(forward, key.tokens, step_lora, _Pieces(), capture=False,
                             stream=None, meta=meta)
        finally:
            for attn in self.attention:
                attn.split = None

    @torch.inference_mode()
    def capture(self, forward: Callable[[int, LoRAStep | None], torch.Tensor],
                lora: dict[int, LoRAStep] | None) -> None:
        """Capture `forward(tokens, lora_step)` in pieces for every size, with lora_step=None
        and, on a LoRA engine, with each of `lora`'s steps (slot bound -> step). The caller has
        set its static inputs to padding tokens (scratch slot, LoRA slot -1)."""
        if self.with_lora != bool(lora):
            raise ValueError(f"PrefillGraphs(with_lora={self.with_lora}) needs "
                             f"{'LoRA steps' if self.with_lora else 'no LoRA step'} to capture")
        t0 = time.perf_counter()
        sets = [(0, None)] + [(k, lora[k]) for k in sorted(lora or {}, reverse=True)]
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        try:
            for slots, step_lora in sets:
                for size in reversed(self.sizes):  # warm-up: Triton compiles, cuBLAS picks
                    self._run(forward, size, step_lora, _Pieces(), capture=False, stream=None)
                torch.cuda.synchronize()
                for size in reversed(self.sizes):  # largest first: smaller ones reuse its memory
                    pieces = _Pieces()
                    self._run(forward, size, step_lora, pieces, capture=True, stream=stream)
                    self.pieces[PrefillKey(size, slots)] = pieces
            torch.cuda.synchronize()
        finally:
            for attn in self.attention:
                attn.split = None
        self.stats = {"capture_s": time.perf_counter() - t0, "sizes": list(self.sizes),
                      "slot_bounds": [slots for slots, _ in sets],
                      "num_captures": len(self.pieces),
                      "pieces_per_capture": len(self.attention) + 1}

    def _run(self, forward, size: int, step_lora, pieces: _Pieces, capture: bool,
             stream, meta: AttnMetadata | None = None) -> torch.Tensor:
        split = _Split(pieces, self.q, self.out, self.pool, capture, meta)
        for attn in self.attention:
            attn.split = split
        if not capture:
            pieces.hidden = forward(size, step_lora)
            return pieces.hidden
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            pieces.graphs.append(graph)
            pieces.hidden = forward(size, step_lora)
            pieces.graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        if split.calls != len(self.attention):
            raise AssertionError(f"the forward called attention {split.calls} times for "
                                 f"{len(self.attention)} attention layers")
        return pieces.hidden
