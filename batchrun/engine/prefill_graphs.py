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

Pieces are captured per padded token count (cudagraph_dispatcher.token_buckets) and, on a
LoRA engine, once more per slot bound (the LoRA kernels read each token's slot from the
runner's static buffer, as fused decode graphs do); cudagraph_dispatcher.py keys, dispatches
and captures them. Padding tokens write their K/V into the scratch block and belong to no
sequence, so the attention leaves their rows alone; their rows carry garbage through the
row-wise layers and are never read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchrun.engine.cudagraph_dispatcher import Forward, GraphKey
from batchrun.engine.envs import env_name
from batchrun.engine.layers.attention import AttnMetadata, PagedAttention
from batchrun.engine.layers.step import LoRAStep


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
    decode_only = False
    failure_hint = ("capturing the piecewise prefill graphs failed. Set "
                    f"{env_name('prefill_graph_max_tokens')}=0 to run prefill steps eagerly (same "
                    "outputs, slower small prefills)")

    def __init__(self, sizes: list[int], attention: list[PagedAttention], q: torch.Tensor,
                 out: torch.Tensor):
        # q, out: the static query and attention output buffers, [>= max(sizes), Hq, D] each,
        # shared by every layer and size
        if not sizes:
            raise ValueError("prefill graphs need at least one token count to capture")
        self.sizes = list(sizes)
        self.attention, self.q, self.out = attention, q, out
        self.pieces: dict[GraphKey, _Pieces] = {}
        self.pool = None  # set by CudaGraphs.capture
        self._stream = None  # the side stream captures run on (made at the first capture)
        self.stats: dict = {}
        self.replays = 0  # steps replayed (benchmarks and tests read it)

    def replay(self, key: GraphKey, meta: AttnMetadata) -> torch.Tensor:
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

    def run_eager(self, forward: Forward, key: GraphKey, meta: AttnMetadata,
                  step_lora: LoRAStep | None) -> torch.Tensor:
        """What replay(key, meta) computes, without graphs: the same padded forward over the
        static inputs, split the same way, each attention run on `meta` (CPU tests)."""
        return self._run(forward, key.tokens, step_lora, _Pieces(), capture=False, meta=meta)

    def warm_up(self, forward: Forward, size: int, lora: LoRAStep | None) -> None:
        self._run(forward, size, lora, _Pieces(), capture=False)

    def capture_one(self, forward: Forward, key: GraphKey, lora: LoRAStep | None) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        pieces = _Pieces()
        self._run(forward, key.tokens, lora, pieces, capture=True)
        self.pieces[key] = pieces

    def record_stats(self, capture_s: float, slot_bounds: list[int], pool_bytes: dict) -> None:
        self.stats = {"capture_s": capture_s, "sizes": list(self.sizes),
                      "slot_bounds": list(slot_bounds), "num_captures": len(self.pieces),
                      "pieces_per_capture": len(self.attention) + 1, "pool_bytes": pool_bytes}

    def _run(self, forward: Forward, size: int, step_lora, pieces: _Pieces, capture: bool,
             meta: AttnMetadata | None = None) -> torch.Tensor:
        split = _Split(pieces, self.q, self.out, self.pool, capture, meta)
        for attn in self.attention:
            attn.split = split
        try:
            if not capture:
                pieces.hidden = forward(size, step_lora)
                return pieces.hidden
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(pool=self.pool)
                pieces.graphs.append(graph)
                pieces.hidden = forward(size, step_lora)
                pieces.graphs[-1].capture_end()
            torch.cuda.current_stream().wait_stream(stream)
        finally:
            for attn in self.attention:
                attn.split = None
        if split.calls != len(self.attention):
            raise AssertionError(f"the forward called attention {split.calls} times for "
                                 f"{len(self.attention)} attention layers")
        return pieces.hidden
