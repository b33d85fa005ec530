"""Continuous batching: each step is a mixed step (decode rows + prefill chunks), a prefill
step or a decode step.

- Mixed steps (`BATCHRUN_MIXED_STEPS=1`, off by default; vLLM's unified scheduling): while there is
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

The scheduler is the only writer of sequence state. `schedule()` plans a step and advances
what the step will do (vLLM's `_update_after_schedule`): each row's `num_computed` moves past
the tokens it computes, and each row the step samples gets one pending token
(`Sequence.num_pending`) at its row of the step's sampled tokens (`pending_row`). The batch
keeps what the rows were before (`starts`, `pending_rows`), which is what the model runner
reads. `update()` takes the sampled tokens back: appends them, runs the stop checks and
finishes rows. So async steps (engine.py) can plan step n+1 before step n's tokens are read.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from batchrun.engine.config import EngineConfig
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.sequence import Sequence, SeqStatus
from batchrun.engine.stop import reaches_length, stop_reason


LORA_LOOKAHEAD = 64  # waiting rows admission looks through past rows that wait for a LoRA slot


@dataclass(frozen=True)
class ScheduledBatch:
    """One planned step. The lists are per row of `seqs`; `starts` and `pending_rows` are the
    rows' state before the step (the sequences themselves already hold the state after it)."""
    is_prefill: bool  # False: a pure decode step (CUDA graphs); True: prefill or mixed
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens computed this step per sequence (1 each in decode)
    num_decode: int = 0  # prefill/mixed: seqs[:num_decode] are decode rows (1 token each)
    starts: list[int] = field(default_factory=list)  # first position computed (num_computed before)
    # the row of the previous step's sampled tokens that holds this row's newest token (still on
    # the device: its input id comes from there), -1 when the token is on the host
    pending_rows: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # rows that sample a token, in sample order

    @property
    def is_mixed(self) -> bool:
        return self.is_prefill and self.num_decode > 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, lora=None,
                 eos_ids: frozenset[int] = frozenset(), tokenizer=None,
                 long_rope_from: int | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_batched = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.mixed = config.experiments.mixed_steps
        # the stop checks update() runs: EOS ids and stop strings (Engine.scheduler() passes the
        # engine's; one built without them knows no EOS id and cannot check stop strings)
        self.eos_ids, self.tokenizer = eos_ids, tokenizer
        self.blocks = block_manager
        self.lora = lora  # LoRAManager or None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0  # KV tokens dropped by preemption and computed again later
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache at admission
        self.prefix_hit_tokens = 0  # ... and the ones found there (not computed)
        # LongRoPE (Phi-3 128k, Phi-4-mini): the pretraining length; a sequence longer than it
        # is rotated with the long table, all of its positions, as transformers computes it
        self.long_rope_from = long_rope_from

    def add(self, seq: Sequence) -> None:
        if self.long_rope_from is not None and seq.num_tokens > self.long_rope_from:
            seq.long_rope = True
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Plan the next step and advance its rows' state past it (module doc); an empty
        batch when nothing can run."""
        plan = self._schedule_prefill()
        if not plan[1]:
            plan = self._schedule_decode()
        return self._advance(*plan)

    def _advance(self, is_prefill: bool, seqs: list[Sequence], counts: list[int],
                 num_decode: int) -> ScheduledBatch:
        starts = [s.num_computed for s in seqs]
        pending = [s.pending_row if s.num_pending else -1 for s in seqs]
        sampled = [i for i, (s, n) in enumerate(zip(seqs, counts)) if s.num_computed + n == s.num_tokens]
        for s, n in zip(seqs, counts):
            s.num_computed += n
        for j, i in enumerate(sampled):
            seqs[i].num_pending += 1
            seqs[i].pending_row = j
        return ScheduledBatch(is_prefill, seqs, counts, num_decode, starts, pending, sampled)

    def update(self, seqs: list[Sequence], tokens: list[int], logprobs: list, top_logprobs: list
               ) -> list[Sequence]:
        """Take a step's sampled tokens back (`seqs`: the rows it sampled, in order): append
        each token, run the stop checks, finish the rows that end; returns those. A row that
        finished at the step before (async steps) drops its token."""
        finished = []
        for seq, tok, lp, top in zip(seqs, tokens, logprobs, top_logprobs):
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_pending -= 1
            seq.token_ids.append(tok)
            if seq.grammar is not None:
                seq.grammar.accept_token(tok)
            if lp is not None:
                seq.logprobs.append(lp)
                seq.top_logprobs.append(top)
            reason = stop_reason(seq, tok, self.eos_ids, self.tokenizer, self.max_model_len)
            if reason:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _schedule_prefill(self) -> tuple[bool, list[Sequence], list[int], int]:
        budget, decode, preempted = self.max_batched, [], False
        if self.mixed and self._prefill_fits_beside_decode():
            decode, preempted = self._schedule_decode_rows()
            budget -= len(decode)
        seqs, counts = self._continue_prompts(budget)
        budget -= sum(counts)
        if not preempted or not decode:
            self._admit(seqs, counts, budget)
        if decode and not seqs:  # nothing to prefill after all: a plain decode step (graphs)
            return self._decode_plan(decode)
        return True, decode + seqs, [1] * len(decode) + counts, len(decode)

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
            if (self.long_rope_from is not None and not seq.long_rope
                    and seq.num_tokens > self.long_rope_from):
                self._switch_to_long_rope(seq)
                continue
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

    def _schedule_decode(self) -> tuple[bool, list[Sequence], list[int], int]:
        # reached only when no running sequence is mid-prompt (_schedule_prefill takes those)
        rows, _ = self._schedule_decode_rows()
        return self._decode_plan(rows)

    def _decode_plan(self, rows: list[Sequence]) -> tuple[bool, list[Sequence], list[int], int]:
        if self.lora is not None and any(s.lora_slot >= 0 for s in rows):
            # an adapter's rows side by side: each row tile of the LoRA kernels then holds one
            # or two slots, so their slot loop runs once or twice (kernels/lora_delta.py)
            rows = sorted(rows, key=lambda s: s.lora_slot)
        return False, rows, [1] * len(rows), 0

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
        self._recompute(seq)
        self.num_preemptions += 1

    def _recompute(self, seq: Sequence) -> None:
        """Drop seq's K/V and put it first in line to be prefilled again (prompt + outputs)."""
        self.running.remove(seq)
        self._release(seq)
        self.num_recomputed_tokens += seq.num_computed
        seq.preempted_computed = seq.num_computed
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def _switch_to_long_rope(self, seq: Sequence) -> None:
        """The sequence grows past the LongRoPE pretraining length: transformers then computes
        every position again with the long table (Phi3ForCausalLM drops its KV cache there), so
        its K/V are dropped and it is prefilled again, as a preemption does; its cached blocks
        (short table) are not reused (block_manager: a separate hash root)."""
        self._recompute(seq)
        seq.long_rope = True
        seq.block_hashes = []

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
