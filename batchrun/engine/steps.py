"""Executing a scheduled step: the model runner's forward, the grammar mask and the sampling,
queued on the device. The engine's loop (engine.py) is schedule -> execute -> update; this is
the middle call. It reads the batch and the sequences and writes neither (the scheduler owns
sequence state): what a step changes comes back as a `Launched` for `Scheduler.update`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from batchrun.engine.sampler import PendingSample, RowState, sample_async
from batchrun.engine.scheduler import ScheduledBatch
from batchrun.engine.sequence import Sequence


@dataclass(frozen=True)
class Launched:
    """A step queued on the device whose tokens the host has not read yet."""
    batch: ScheduledBatch
    seqs: list[Sequence]  # the rows it samples, in the order of sampled.tokens
    sampled: PendingSample
    needs_sync: bool  # a row's next step needs its tokens on the host (penalties, grammar)


class StepExecutor:
    """Runs scheduled steps on one model runner.

    runner: the ModelRunner; eos_ids: the token ids that end a row (the sampler's min_tokens
    mask); grammars: returns the engine's grammar compiler (made on first use); stats: the
    engine's counters, whose step counts this increments.
    """

    def __init__(self, runner, eos_ids: frozenset[int], grammars: Callable[[], object],
                 stats: dict):
        self.runner, self.eos_ids, self.grammars, self.stats = runner, eos_ids, grammars, stats

    def execute(self, batch: ScheduledBatch, prev: Launched | None) -> Launched | None:
        """Queue `batch` and its sampling on the device; None when it samples no row (a
        prefill step that completes no prompt). Rows whose newest token is still on the device
        read it from `prev`'s tokens there."""
        prev_tokens = None if prev is None else prev.sampled.tokens
        self.stats["steps"] += 1
        if batch.is_prefill:
            self.stats["mixed_steps" if batch.is_mixed else "prefill_steps"] += 1
            logits = self.runner.prefill(batch, prev_tokens)
        else:
            self.stats["decode_steps"] += 1
            logits = self.runner.decode(batch, prev_tokens)
        seqs = [batch.seqs[i] for i in batch.sampled]
        if not seqs:
            return None
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:  # only rows with a response_format pay for the grammar mask
            logits = self.grammars().mask(logits, constrained, [seqs[i].grammar for i in constrained])
        rows = [RowState(s.sampling, s.generator.initial_seed() if s.generator else 0,
                         s.token_ids, s.prompt_len, int(batch.pending_rows[i] >= 0))
                for i, s in zip(batch.sampled, seqs)]
        sampled = sample_async(logits, rows, self.eos_ids)
        needs_sync = bool(constrained) or any(s.sampling.penalized for s in seqs)
        return Launched(batch, seqs, sampled, needs_sync)
