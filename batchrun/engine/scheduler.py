"""Continuous batching: each step is a mixed step (decode rows + prefill chunks), a prefill
step or a decode step.

- Mixed steps (`enable_mixed_steps`, the default; vLLM's unified scheduling): while there is
  prompt work, one step carries every running row's next decode token first (each after
  `_make_room` for its next KV slot, preempting as a decode step does), then chunks of prompts
  still mid-way, then newly admitted sequences, all within `max_num_batched_tokens`. Decode
  rows' room is made before any prefill chunk is picked, so a preemption never drops a row
  already put in the step; a step whose decode rows preempted a sequence admits none (the
  victim would only come back to be preempted again). Decode rows go first so that the model
  runner can hand them to the decode attention kernel as one block (`AttnMetadata.num_decode`).
  When the decode rows leave no token of the budget (more running rows than
  max_num_batched_tokens), the step is a prefill step as below.
- Prefill steps (mixed steps off): sequences still mid-prompt continue, then waiting sequences
  are admitted while `max_num_seqs`, the `max_num_batched_tokens` budget, free KV blocks for
  the whole prompt and LoRA slots allow (a row waiting for a LoRA slot is stepped over, up to
  LORA_LOOKAHEAD rows, by rows that can run: `_next_admissible`). A prompt longer than the budget is prefilled in chunks
  over several steps, so a long prompt never needs more activation memory than one budget's
  worth of tokens.
- With prefix caching an admitted sequence starts after the cached blocks of its prompt
  (block_manager.admit), and every scheduled sequence registers the full blocks this step
  fills, so rows admitted next (in this step too: the n samples of one row, rows sharing a
  system prompt) take them instead of computing them again.
- Otherwise (nothing to prefill) every running sequence decodes one token: a decode step, the
  one CUDA graphs replay. A sequence that needs a new KV block when none is free preempts the
  most recently admitted sequence (recompute: its blocks are freed and it goes back to the
  front of the queue with its outputs so far as part of its prompt).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

from batchrun.engine.config import EngineConfig
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.sequence import Sequence, SeqStatus
from batchrun.engine.stop import reaches_length


LORA_LOOKAHEAD = 64  # waiting rows admission looks through past rows that wait for a LoRA slot


@dataclass
class ScheduledBatch:
    is_prefill: bool  # False: a pure decode step (CUDA graphs); True: prefill or mixed
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens computed this step per sequence (1 each in decode)
    num_decode: int = 0  # prefill/mixed: seqs[:num_decode] are decode rows (1 token each)

    @property
    def is_mixed(self) -> bool:
        return self.is_prefill and self.num_decode > 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, lora=None):
        self.max_num_seqs = config.max_num_seqs
        self.max_batched = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.mixed = config.enable_mixed_steps
        self.blocks = block_manager
        self.lora = lora  # LoRAManager or None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # KV tokens dropped by preemption and computed again later
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0  # ... and the ones found there (not computed)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = self._schedule_prefill()
        if batch.seqs:
            return batch
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch:
        budget, decode, preempted = self.max_batched, [], False
        if self.mixed and self._prefill_fits_beside_decode():
            decode, preempted = self._schedule_decode_rows()
            budget -= len(decode)
        seqs, counts = self._continue_prompts(budget)
        budget -= sum(counts)
        if not preempted or not decode:
            self._admit(seqs, counts, budget)
        if decode and not seqs:  # nothing to prefill after all: a plain decode step (graphs)
            return ScheduledBatch(False, decode, [1] * len(decode))
        return ScheduledBatch(True, decode + seqs, [1] * len(decode) + counts, len(decode))

    def _prefill_fits_beside_decode(self) -> bool:
        """A mixed step is worth scheduling: some prompt work waits and the decode rows leave
        at least one token of the budget for it."""
        decode = sum(1 for s in self.running if not s.needs_prefill)
        if decode == 0 or decode >= self.max_batched:
            return False
        return (any(s.needs_prefill for s in self.running)
                or (bool(self.waiting) and len(self.running) < self.max_num_seqs))

    def _schedule_decode_rows(self) -> tuple[list[Sequence], bool]:
        """Room for each running decode row's next token, oldest first (a victim is always the
        newest row, never one already taken). Returns the rows and whether any preemption
        happened."""
        rows, before = [], self.num_preemptions
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.needs_prefill:
                continue  # preempted while making room for an earlier row / a prompt chunk
            if seq.num_pending and reaches_length(seq, seq.num_tokens, self.max_model_len):
                continue  # async steps: the step in flight gave it its last token
            if self._make_room(seq, seq.num_tokens):
                rows.append(seq)
        return rows, self.num_preemptions > before

    def _continue_prompts(self, budget: int) -> tuple[list[Sequence], list[int]]:
        """The next chunk of each running sequence still mid-prompt, within budget."""
        seqs, counts = [], []
        for seq in self.running:
            if budget == 0:
                break
            if seq.needs_prefill and seq.status is SeqStatus.RUNNING:
                n = min(seq.num_tokens - seq.num_computed, budget)
                self.blocks.cache_blocks(seq, seq.num_computed + n)
                seqs.append(seq); counts.append(n); budget -= n
        return seqs, counts

    def _admit(self, seqs: list[Sequence], counts: list[int], budget: int) -> None:
        """Admit waiting sequences (their first chunk appended to seqs/counts) within budget."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_admissible()
            if seq is None:
                break  # every LoRA slot the look-ahead's rows need is pinned: wait until one frees
            # blocks for the whole prompt up front: a chunked prompt never stalls mid-way
            if not self.blocks.admit(seq):
                break
            if self.blocks.enable_caching:
                self.prefix_queried_tokens += seq.num_tokens
                self.prefix_hit_tokens += seq.num_computed
                if seq.num_preemptions:  # what preemption dropped but the cache kept is not recomputed
                    self.num_recomputed_tokens -= seq.num_computed
            n = min(seq.num_tokens - seq.num_computed, budget)
            self._take_waiting(seq)
            self.blocks.cache_blocks(seq, seq.num_computed + n)
            if seq.adapter and self.lora is not None:
                seq.lora_slot = self.lora.acquire(seq.adapter)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq); counts.append(n); budget -= n

    def _take_waiting(self, seq: Sequence) -> None:
        # by identity (within the first LORA_LOOKAHEAD rows: a short scan)
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            del self.waiting[next(i for i, s in enumerate(self.waiting) if s is seq)]

    def _next_admissible(self) -> Sequence | None:
        """The first of the first LORA_LOOKAHEAD waiting sequences that can run now: a base row,
        or one whose adapter is resident or can get a slot. A row whose adapter has no free
        slot (all pinned by running rows) no longer blocks base rows and rows of resident
        adapters behind it. Rows of one adapter keep their order (they get the same answer),
        and a skipped row keeps its place at the head, so it is the first to get a slot that
        frees. Only slot waits are skipped: a row that does not fit the KV blocks still stops
        admission (the caller), so a long prompt is not starved by short ones."""
        if self.lora is None:
            return self.waiting[0]
        for seq in islice(self.waiting, LORA_LOOKAHEAD):
            if not seq.adapter or self.lora.can_acquire(seq.adapter):
                return seq
        return None

    def _schedule_decode(self) -> ScheduledBatch:
        # reached only when no running sequence is mid-prompt (_schedule_prefill takes those)
        rows, _ = self._schedule_decode_rows()
        return ScheduledBatch(False, rows, [1] * len(rows))

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Allocate blocks for seq's first num_tokens tokens, preempting the newest sequences."""
        if self.blocks.is_ready(seq, num_tokens):
            return True  # most decode steps: the next token fits the last block
        while not self.blocks.can_allocate(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq, num_tokens)
        self.blocks.cache_blocks(seq, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.num_recomputed_tokens += seq.num_computed
        seq.preempted_computed = seq.num_computed
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.WAITING:
            # async steps: preempted while its last token was on its way from the device; the
            # tokens counted as to be recomputed never will be
            self._take_waiting(seq)
            self.num_recomputed_tokens -= seq.preempted_computed
        else:
            self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def abort(self) -> None:
        """Drop every sequence (the caller stopped on an error): hand back their KV blocks and
        LoRA slot pins, which outlive this scheduler (the engine's block manager and slots),
        and empty the prefix cache."""
        for seq in self.running:
            self._release(seq)
        self.running, self.waiting = [], deque()
        self.blocks.reset_cache()  # blocks registered for the failed step may hold no K/V

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        if seq.adapter and self.lora is not None and seq.lora_slot >= 0:
            self.lora.release(seq.adapter)
        seq.lora_slot = -1
