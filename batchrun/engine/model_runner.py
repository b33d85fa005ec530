"""Prepare batched inputs, run prefill (and mixed) and decode steps on the model.

Every step is planned here once: which captured graphs it replays (`dispatch`), its LoRA part
(slot bound, fused or not) and the GEMM each projection kind runs (step_plan.py), carried to
the layers in one frozen `Step` (layers/step.py: attention metadata, `lora`, None when no token
has an adapter, and `gemm`) passed through `model(...)`; nothing per step is kept on a shared
object and no layer picks a kernel. The runner owns its CUDA graphs
(cudagraph_dispatcher.CudaGraphs: full decode graphs, graphs.py, and piecewise graphs for
prefill steps of at most prefill_graph_max_tokens tokens, prefill_graphs.py): `capture_graphs()`
makes them, `eager()` runs steps without them for a while (benchmarks,
profilers); `graphs` and `prefill_graphs` are read-only from outside.

Decode reads its inputs from static buffers kept as attributes (token ids, positions, slot
mapping, block tables, context lengths, LoRA token slots), sized for max_num_seqs and written in
place every step, so a captured CUDA graph (graphs.py) can replay the same step. Rows past the
step's batch size are padding: slot -1 (no LoRA), context length 0, and their K/V go to the
scratch block 0, so they do no harmful work. Small prefill steps likewise write their tokens
into static prefill buffers padded to a captured token count (`_write_prefill_inputs`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from batchrun.engine.config import EngineConfig
from batchrun.engine.block_manager import SCRATCH_BLOCK, BlockManager
from batchrun.engine.cudagraph_dispatcher import (CudaGraphs, GraphKey, Mode, capture_sizes,
                                                   token_buckets)
from batchrun.engine.graphs import DecodeGraphs
from batchrun.engine.prefill_graphs import PrefillGraphs
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.engine.sequence import Sequence
from batchrun.engine.layers.attention import AttnMetadata, query_start_tensor
from batchrun.engine.layers.backend import use_triton
from batchrun.engine.layers.step import GemmPlan, LoRAStep, Step
from batchrun.engine.kv_sizing import kv_cache_dtype
from batchrun.engine.step_plan import fp8_kinds, plan_gemms, weight_shapes


_SCRATCH_ROW = ("scratch",)  # _table_keys entry of a padding row


class ModelRunner:
    def __init__(self, model, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 blocks: BlockManager, lora=None):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.blocks, self.lora = blocks, lora
        # the step plan's GEMM choice (step_plan.py): the switch, the weights' shapes, and a
        # tensor of the model's dtype on its device
        self._triton_gemm = config.experiments.triton_decode_gemm
        self._shapes = weight_shapes(model)
        self._fp8 = fp8_kinds(model)
        self._probe = torch.empty(0, dtype=dtype, device=device)
        cfg = model.config
        self.block_size = blocks.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        # KV cache: [2, layers, num_blocks, block_size, Hkv, D]
        # (e4m3 for kv_cache_dtype fp8: each layer's attention holds its k/v scales)
        self.kv_cache = torch.zeros(2, cfg.num_hidden_layers, blocks.num_blocks, self.block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, device=device,
                                    dtype=kv_cache_dtype(config, dtype))
        fp8_kv = self.kv_cache.dtype == torch.float8_e4m3fn
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            attn.k_scale, attn.v_scale = attn.checkpoint_kv_scales if fp8_kv else (1.0, 1.0)
        # LongRoPE: a sequence longer than the pretraining length (Sequence.long_rope, set by
        # the scheduler) reads the long table, whose rows follow the short one's
        # (layers/rotary.py); offset 0 for every other rope
        rotary = model.model.rotary
        self.long_rope_from, self._long_offset = rotary.long_from, rotary.long_offset
        n, mb = config.max_num_seqs, self.max_blocks_per_seq
        # Static decode inputs live in two device buffers (int64 and int32), so a step's inputs
        # cost two host->device copies. Views:
        self._i64 = torch.zeros(5, n, dtype=torch.long, device=device)
        self._i32 = torch.zeros(n * (2 + mb), dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self._i64[:3]  # [n] each
        # rows whose input id is a token still on the device (async steps): input_ids[dst[j]] =
        # the previous step's tokens[src[j]] (not read by the graphs)
        self._pending_dst, self._pending_src = self._i64[3], self._i64[4]
        self.context_lens, self.token_slots = self._i32[:n], self._i32[n:2 * n]  # [n] each
        self.block_tables = self._i32[2 * n:].view(n, mb)  # [n, max_blocks_per_seq]
        self.logits = torch.empty(n, cfg.vocab_size, dtype=torch.float32, device=device)  # [n, V]
        # Two pinned host mirrors of each, used by turns: with async steps the host writes step
        # n+1's inputs while step n may not have copied its own yet; step n-1's copies are done
        # (the engine waited for its tokens) and it used the other pair.
        pin = device.type == "cuda"
        self._host = [(torch.zeros(self._i64.shape, dtype=torch.long, pin_memory=pin),
                       torch.zeros(self._i32.shape, dtype=torch.int32, pin_memory=pin))
                      for _ in range(2)]
        self._turn = 0
        # per pair, per row of its host block table: (the block_ids list it was written from,
        # its length)
        self._table_keys: list[list] = [[None] * n for _ in range(2)]
        self._graphs: CudaGraphs | None = None  # capture_graphs()
        self._eager = False  # eager(): decode without graphs even when they are captured
        # The LoRA part of every fused LoRA decode step (the Triton path), captured graphs
        # included, one per slot bound k (a step's rows all have slots < k): the kernels read
        # each row's slot straight from token_slots, which the step writes with its other
        # inputs, so such a step writes no LoRA metadata at all.
        self._fused_decode_lora = (None if lora is None else {
            k: lora.lora_step(self.token_slots, has_lora=True, fuse=True,
                              bound_slots=self.token_slots, num_slots=k)
            for k in lora.slot_bounds})
        # Piecewise prefill graphs (prefill_graphs.py), captured with the decode graphs:
        # static inputs for up to prefill_graph_max_tokens tokens (ids, positions, K/V slots;
        # LoRA slots), the attention output every layer's eager attention writes, and one
        # LoRAStep per slot bound reading the static LoRA slots (as fused decode steps do)
        pt = 0 if config.enforce_eager else min(config.experiments.prefill_graph_max_tokens,
                                                 config.max_num_batched_tokens)
        self._prefill_tokens = pt  # captured by capture_graphs() (CUDA only)
        if pt:
            self._p64 = torch.zeros(3, pt, dtype=torch.long, device=device)
            self._p_slots = torch.full((pt,), -1, dtype=torch.int32, device=device)
            self._p_q, self._p_out = (torch.zeros(pt, cfg.num_attention_heads, cfg.head_dim,
                                                  dtype=dtype, device=device) for _ in range(2))
            self._prefill_lora = (None if lora is None else {
                k: lora.lora_step(self._p_slots, has_lora=True, fuse=True,
                                  bound_slots=self._p_slots, num_slots=k)
                for k in lora.slot_bounds})

    # ---- CUDA graphs --------------------------------------------------------------------
    @property
    def graphs(self) -> DecodeGraphs | None:
        """The captured decode graphs (None until capture_graphs())."""
        return None if self._graphs is None else self._graphs.decode

    @property
    def prefill_graphs(self) -> PrefillGraphs | None:
        """The captured piecewise prefill graphs (None until capture_graphs(), or when off)."""
        return None if self._graphs is None else self._graphs.prefill

    def capture_graphs(self) -> None:
        if self._graphs is not None:
            raise RuntimeError("CUDA graphs are already captured for this model runner")
        decode = DecodeGraphs(capture_sizes(self.config.max_num_seqs, self.config.cuda_graph_sizes))
        prefill = (PrefillGraphs(token_buckets(self._prefill_tokens), self.model.attention_layers(),
                                 self._p_q, self._p_out) if self._prefill_tokens else None)
        graphs = CudaGraphs(self.lora is not None, decode, prefill)
        # decode inputs of a step made only of padding rows: scratch block, no context, no
        # LoRA (a LoRA set's kernels launch and skip the work)
        self.input_ids.zero_(); self.positions.zero_(); self.slot_mapping.zero_()
        self.context_lens.zero_(); self.block_tables.zero_(); self.token_slots.fill_(-1)
        if prefill is not None:  # padding tokens: token 0 at position 0, the scratch block
            self._p64.zero_()
            self._p64[2].fill_(SCRATCH_BLOCK * self.block_size)
            self._p_slots.fill_(-1)
        graphs.capture({True: (self.decode_forward, self._fused_decode_lora),
                        False: (self.prefill_forward, self._prefill_lora if prefill else None)})
        self._graphs = graphs

    def dispatch(self, num_tokens: int, decode_only: bool, lora_slots: int, *, fused: bool = True,
                 piecewise: bool = True) -> tuple[Mode, GraphKey | None]:
        """Which captured graphs a step replays (cudagraph_dispatcher.dispatch); eager when
        none are captured or inside eager()."""
        if self._graphs is None or self._eager:
            return Mode.EAGER, None
        return self._graphs.dispatch(num_tokens, decode_only, lora_slots, fused=fused,
                                     piecewise=piecewise)

    def prefill_forward(self, tokens: int, lora: LoRAStep | None) -> torch.Tensor:
        """The prefill a PrefillGraphs captures in pieces: reads the static inputs' first
        `tokens` tokens; the attention metadata is only the K/V slots (the rotary writes them),
        the rest comes with each replay's eager attention."""
        empty = self._p_slots[:0]
        attn = AttnMetadata(True, self._p64[2, :tokens], empty.view(0, 1), empty,
                            query_lens=[], context_lens_host=[], query_start=self._p_slots[:1])
        return self.model(self._p64[0, :tokens], self._p64[1, :tokens],
                          Step(attn, lora, self.gemms(tokens)))

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Decode and prefill steps inside the block run eagerly (the graphs stay captured)."""
        saved, self._eager = self._eager, True
        try:
            yield
        finally:
            self._eager = saved

    # ---- decode -------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, batch: ScheduledBatch, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence of a decode batch -> fp32 logits [len(batch.seqs), V]. A row
        whose newest token is still on the device (batch.pending_rows) reads it from
        `prev_tokens`, the previous step's sampled tokens, at that row."""
        seqs = batch.seqs
        b = len(seqs)
        k = self.decode_slot_bound(seqs)
        mode, key = self.dispatch(b, True, k)
        rows = key.tokens if mode is Mode.FULL else b
        lora = self._write_decode_inputs(seqs, batch.starts, batch.pending_rows, rows, k, prev_tokens)
        if mode is Mode.FULL:
            return self._graphs.replay(key)[:b]
        return self.decode_forward(rows, lora)[:b]

    def decode_slot_bound(self, seqs: list[Sequence]) -> int:
        """The slot bound of a decode step of `seqs` (0: no adapter row), which picks its graph
        set and how many slots' A rows its fused GEMMs stream."""
        top = max(s.lora_slot for s in seqs)
        if top < 0:
            return 0
        if self.lora is None:
            raise AssertionError("a LoRA row reached an engine without LoRA")
        return self.lora.slot_bound(top)

    def decode_forward(self, rows: int, lora: LoRAStep | None) -> torch.Tensor:
        """The step a graph captures: reads only the static buffers' first `rows` rows (and
        the static LoRA buffers `lora` names; None = the LoRA-disabled kernels only)."""
        attn = AttnMetadata(False, self.slot_mapping[:rows], self.block_tables[:rows],
                            self.context_lens[:rows])
        gemms = self.gemms(rows)
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], Step(attn, lora, gemms))
        # into a static buffer shared by every graph of both sets: captured graphs then keep no
        # per-graph output alive in the pool (a [rows, vocab] fp32 tensor per graph otherwise)
        return self.model.compute_logits(hidden, gemms.lm_head, out=self.logits[:rows])

    def gemms(self, rows: int) -> GemmPlan:
        """The GEMM each projection kind runs in a forward over `rows` rows (step_plan.py)."""
        return plan_gemms(self._triton_gemm, rows, self._probe, self._shapes, self._fp8)

    def _write_decode_inputs(self, seqs: list[Sequence], starts: list[int], pending_rows: list[int],
                             rows: int, num_slots: int,
                             prev_tokens: torch.Tensor | None) -> LoRAStep | None:
        n, bs = self.config.max_num_seqs, self.block_size
        turn = self._turn
        self._turn ^= 1
        host_i64, host_i32 = self._host[turn]
        h64, h32 = host_i64.numpy(), host_i32.numpy()
        b = len(seqs)  # rows b..rows are padding: scratch block, no context, no LoRA
        lens = [p + 1 for p in starts]  # context length: the positions before the token, and it
        lora = [s.lora_slot for s in seqs]
        h64[0, :b] = [0 if j >= 0 else s.token_ids[p] for s, p, j in zip(seqs, starts, pending_rows)]
        pending = [(i, j) for i, j in enumerate(pending_rows) if j >= 0]
        h64[1, :b] = (starts if self.long_rope_from is None
                      else [p + self._long_offset * s.long_rope for s, p in zip(seqs, starts)])
        slot = self.blocks.slot
        h64[2, :b] = [slot(s, m - 1) for s, m in zip(seqs, lens)]
        h32[:b], h32[n:n + b] = lens, lora
        self._write_block_tables(seqs, rows, turn)
        h64[:3, b:rows] = 0
        h64[2, b:rows] = SCRATCH_BLOCK * bs
        h32[b:rows], h32[n + b:n + rows] = 0, -1
        in_order = len(pending) == b and all(i == j for i, j in pending)
        if pending and not in_order:
            h64[3, :len(pending)], h64[4, :len(pending)] = zip(*pending)
        self._i64.copy_(host_i64, non_blocking=True)
        self._i32.copy_(host_i32, non_blocking=True)
        if in_order:  # the usual step: the previous step's rows, in the same order
            self.input_ids[:b].copy_(_prev_tokens(prev_tokens)[:b])
        elif pending:
            m = len(pending)
            _take_pending(self.input_ids, self._pending_dst[:m], self._pending_src[:m], prev_tokens)
        if not num_slots:  # slot bound 0: no adapter row
            return None
        # decode on the Triton path: LoRA deltas ride into the kernels after each projection,
        # which read each row's slot from token_slots (written above)
        if use_triton(self._i64):
            return self._fused_decode_lora[num_slots]
        return self.lora.lora_step(lora + [-1] * (rows - b), has_lora=True, num_slots=num_slots)

    def _write_block_tables(self, seqs: list[Sequence], rows: int, turn: int) -> None:
        """Rows of the host block table of pair `turn` that changed since that pair's last
        decode step: a row's blocks only grow (extend) or are replaced by a new list
        (admission, preemption), so a row still holding the same list at the same length is as
        it was. Padding rows (len(seqs)..rows) point at the scratch block."""
        n, mb = self.config.max_num_seqs, self.max_blocks_per_seq
        tables = self._host[turn][1].numpy()[2 * n:].reshape(n, mb)
        keys = self._table_keys[turn]
        for i, s in enumerate(seqs):
            ids, key = s.block_ids, keys[i]
            if key is not None and key[0] is ids and key[1] == len(ids):
                continue
            tables[i, :len(ids)] = ids
            tables[i, len(ids):] = 0
            keys[i] = (ids, len(ids))  # holds the list: its id is not reused while keyed
        for i in range(len(seqs), rows):
            if keys[i] is not _SCRATCH_ROW:
                tables[i] = SCRATCH_BLOCK
                keys[i] = _SCRATCH_ROW

    # ---- prefill (and mixed) -------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, batch: ScheduledBatch, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Compute `batch.num_tokens[i]` tokens of batch.seqs[i] from batch.starts[i] on.
        Returns the fp32 logits [len(batch.sampled), V] of the rows the step samples (those
        whose tokens are now all computed). A decode row whose token is still on the device
        reads it from `prev_tokens` (decode()).

        A mixed step puts its decode rows first: seqs[:num_decode], one token each (the last
        sampled one); attention runs them through the decode kernel and the rest through the
        varlen prefill kernel (layers/attention.py)."""
        seqs, counts, num_decode = batch.seqs, batch.num_tokens, batch.num_decode
        if any(n != 1 for n in counts[:num_decode]):
            raise ValueError(f"prefill: the first num_decode={num_decode} rows must be decode "
                             f"rows of one token each, got counts {counts[:num_decode]}")
        total, bs = sum(counts), self.block_size
        ids = np.empty(total, dtype=np.int64)
        pos = np.empty(total, dtype=np.int64)
        slots = np.empty(total, dtype=np.int64)
        lora = np.empty(total, dtype=np.int32)
        table = np.zeros((len(seqs), self.max_blocks_per_seq), dtype=np.int32)
        ctx_lens, ends, t, pending = [], [], 0, []
        for i, (s, n, start) in enumerate(zip(seqs, counts, batch.starts)):
            end = start + n
            table[i, :len(s.block_ids)] = s.block_ids
            if n == 1:  # decode rows: plain ints beat numpy's per-call cost
                if batch.pending_rows[i] < 0:
                    ids[t] = s.token_ids[start]
                else:  # its newest token is on the device
                    ids[t] = 0
                    pending.append((t, batch.pending_rows[i]))
                pos[t], slots[t] = start + self._long_offset * s.long_rope, self.blocks.slot(s, start)
            else:
                if end > len(s.token_ids):
                    raise AssertionError("a prompt chunk reaches past the tokens known on the host")
                p = np.arange(start, end)
                ids[t:t + n] = s.token_ids[start:end]
                pos[t:t + n] = p + self._long_offset * s.long_rope
                slots[t:t + n] = table[i, p // bs].astype(np.int64) * bs + p % bs
            lora[t:t + n] = s.lora_slot
            t += n
            ctx_lens.append(end)
            ends.append(t - 1)
        dev = self.device
        top = int(lora.max())
        k = 0 if top < 0 else self.lora.slot_bound(top)  # slot bound, 0: no adapter token
        # small prefills fuse their LoRA too (no launches); big ones amortise shrink + expand
        fuse = use_triton(self._i64) and total <= self.config.experiments.lora_fused_max_tokens
        mode, key = self.dispatch(total, False, k, fused=fuse, piecewise=not (num_decode or pending))
        # piecewise graphs: the K/V slots are the static input's (the replay's eager attention
        # reads the rest of the metadata); eager: this step's own
        slot_mapping = (self._write_prefill_inputs(key, ids, pos, slots, lora)
                        if mode is Mode.PIECEWISE else torch.from_numpy(slots).to(dev))
        attn = AttnMetadata(True, slot_mapping, torch.from_numpy(table).to(dev),
                            torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
                            query_lens=list(counts), context_lens_host=ctx_lens,
                            query_start=query_start_tensor(counts, dev), num_decode=num_decode)
        if mode is Mode.PIECEWISE:
            hidden = self._graphs.replay(key, attn)[:total]
        else:
            step_lora = None
            if k:  # None when no token has an adapter: nothing written
                step_lora = self.lora.lora_step(lora.tolist(), has_lora=True, fuse=fuse, num_slots=k)
            ids_dev = torch.from_numpy(ids).to(dev)
            if pending:
                dst, src = (torch.tensor(v, dtype=torch.long, device=dev) for v in zip(*pending))
                _take_pending(ids_dev, dst, src, prev_tokens)
            hidden = self.model(ids_dev, torch.from_numpy(pos).to(dev),
                                Step(attn, step_lora, self.gemms(total)))
        if not batch.sampled:
            return hidden.new_empty(0)
        last = [ends[i] for i in batch.sampled]
        return self.model.compute_logits(hidden[torch.tensor(last, device=dev)],
                                         self.gemms(len(last)).lm_head)

    def _write_prefill_inputs(self, key, ids, pos, slots, lora) -> torch.Tensor:
        """Write a step replaying `key` into the static prefill inputs (padding tokens: token
        0, position 0, the scratch block, no adapter); returns its tokens' K/V slots there."""
        n = len(ids)
        h64 = np.zeros((3, key.tokens), dtype=np.int64)
        h64[0, :n], h64[1, :n], h64[2, :n] = ids, pos, slots
        h64[2, n:] = SCRATCH_BLOCK * self.block_size
        self._p64[:, :key.tokens].copy_(torch.from_numpy(h64))
        if key.lora_slots:
            h32 = np.full(key.tokens, -1, dtype=np.int32)
            h32[:n] = lora
            self._p_slots[:key.tokens].copy_(torch.from_numpy(h32))
        return self._p64[2, :n]


def _prev_tokens(prev_tokens: torch.Tensor | None) -> torch.Tensor:
    if prev_tokens is None:
        raise AssertionError("a decode row's newest token is pending but no previous step's tokens were given")
    return prev_tokens


def _take_pending(ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor,
                  prev_tokens: torch.Tensor | None) -> None:
    """ids[dst[j]] = prev_tokens[src[j]], on the device: the input ids of rows whose newest
    token the previous step sampled and the host has not read yet (async steps)."""
    ids.index_copy_(0, dst, _prev_tokens(prev_tokens).index_select(0, src))
