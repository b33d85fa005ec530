"""How the engine runs a step: plan it, launch it on the device, read its tokens back.

`StepLoop` is the part of `Engine` (engine.py) that runs steps; the engine's loop (`_run`) calls
`_advance` once per turn, benchmarks and tests step by hand with `step`. It uses the engine's
config, stats, runner, lora, eos_ids, tokenizer, max_model_len and grammar engine.

With `engine.async_scheduling` a turn plans and launches step n+1 before it reads step n's
tokens back, so the host's work for a step overlaps the device running the previous one
(`_advance` says how rows cross that gap).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from batchrun.engine.sampler import PendingSample, RowState, sample_async
from batchrun.engine.scheduler import ScheduledBatch, Scheduler
from batchrun.engine.sequence import Sequence, SeqStatus
from batchrun.engine.stop import stop_reason


EMPTY_STEP = ("scheduler produced an empty step with work pending "
              "(KV cache too small for any waiting sequence)")


@dataclass
class Launched:
    """A step queued on the device whose tokens the host has not read yet."""
    batch: ScheduledBatch
    seqs: list[Sequence]  # the rows it samples, in the order of sampled.tokens
    sampled: PendingSample
    needs_sync: bool  # a row's next step needs its tokens on the host (penalties, grammar)


class StepLoop:
    """Mixed into Engine: running one step (see the module doc)."""

    def step(self, sched: Scheduler) -> list[Sequence]:
        """Run one scheduled step to its end (tokens read back); returns the sequences that
        finished. (`_run` overlaps steps instead: `_advance`.)"""
        t0 = time.perf_counter()
        batch = sched.schedule()
        if not batch.seqs:
            raise RuntimeError(EMPTY_STEP)
        launched = self._launch(sched, batch, None)
        finished, wait = ([], 0.0) if launched is None else self._collect(sched, launched)
        self._time_step(batch, t0, wait)
        return finished

    def _advance(self, sched: Scheduler, prev: "Launched | None") -> tuple[list[Sequence], "Launched | None"]:
        """One turn of the loop: plan and launch the next step, then read back the tokens of
        `prev` (the step launched last turn) while the device runs the new one.

        With async_scheduling the host's work for step n+1 (planning, inputs, launches) and for
        step n (appending its tokens, stop checks) overlaps the device running them, as vLLM's
        async scheduling does. The plan of step n+1 cannot see step n's tokens: a row's newest
        token is fed to step n+1 on the device (Sequence.num_pending), a row that step n ends
        (EOS, stop) runs one step too many (that token is dropped) and its KV blocks and slot
        free one step later; a row that step n ends by length is left out of step n+1. Rows
        whose next step reads their tokens on the host (penalties, response_format) make the
        loop wait for them first. Outputs are those of the synchronous loop."""
        t0 = time.perf_counter()
        if prev is not None and (prev.needs_sync or not self.config.async_scheduling):
            finished, wait = self._collect(sched, prev)
            self._time_step(prev.batch, t0, wait)
            return finished, None  # the loop plans the next step once it has taken more rows
        batch = sched.schedule()
        if not batch.seqs:
            if prev is None:
                raise RuntimeError(EMPTY_STEP)
            finished, wait = self._collect(sched, prev)  # rows that only wait to end by length
            self._time_step(prev.batch, t0, wait)
            return finished, None
        cur = self._launch(sched, batch, prev)
        finished, wait = ([], 0.0) if prev is None else self._collect(sched, prev)
        if cur is not None and not self.config.async_scheduling:
            done, w = self._collect(sched, cur)
            finished, wait, cur = finished + done, wait + w, None
        self._time_step(batch, t0, wait)
        return finished, cur

    def _launch(self, sched: Scheduler, batch, prev: "Launched | None") -> "Launched | None":
        """Queue a scheduled step and its sampling on the device; None when it samples no row
        (a prefill step that completes no prompt). Rows with a token pending read it from
        `prev`'s tokens on the device."""
        prev_tokens = None if prev is None else prev.sampled.tokens
        self.stats["steps"] += 1
        if batch.is_prefill:
            self.stats["mixed_steps" if batch.is_mixed else "prefill_steps"] += 1
            # rows in batch order: decode rows (always done) first, then finished prompts
            done, logits = self.runner.prefill(batch.seqs, batch.num_tokens, batch.num_decode,
                                               prev_tokens)
            seqs = [batch.seqs[i] for i in done]
        else:
            self.stats["decode_steps"] += 1
            seqs = batch.seqs
            if self.lora is not None and any(s.lora_slot >= 0 for s in seqs):
                # an adapter's rows side by side: each row tile of the LoRA kernels then holds
                # one or two slots, so their slot loop runs once or twice (kernels/lora_delta.py)
                seqs = sorted(seqs, key=lambda s: s.lora_slot)
            logits = self.runner.decode(seqs, prev_tokens)
        if not seqs:
            return None
        constrained = [i for i, s in enumerate(seqs) if s.sampling.response_format is not None]
        if constrained:  # only rows with a response_format pay for the grammar mask
            g = self._grammar_engine()
            for i in constrained:
                if seqs[i].grammar is None:
                    seqs[i].grammar = g.matcher(seqs[i].sampling.response_format)
            logits = g.mask(logits, constrained, [seqs[i].grammar for i in constrained])
        rows = [RowState(s.sampling, s.generator.initial_seed() if s.generator else 0,
                         s.token_ids, s.prompt_len, s.num_pending) for s in seqs]
        sampled = sample_async(logits, rows, self.eos_ids)
        for j, s in enumerate(seqs):
            s.num_pending += 1
            s.pending_row = j
        needs_sync = bool(constrained) or any(s.sampling.penalized for s in seqs)
        return Launched(batch, seqs, sampled, needs_sync)

    def _collect(self, sched: Scheduler, launched: "Launched") -> tuple[list[Sequence], float]:
        """Read a launched step's tokens back (waiting for them: the seconds waited are
        returned), append them and run the stop checks; returns the rows that finished. A row
        that finished at the step before (async steps) drops its token."""
        t = time.perf_counter()
        out = launched.sampled.result()
        wait = time.perf_counter() - t
        finished = []
        for seq, tok, lp, top in zip(launched.seqs, out.tokens, out.logprobs, out.top_logprobs):
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
                sched.finish(seq, reason)
                finished.append(seq)
        return finished, wait

    def _time_step(self, batch: ScheduledBatch, t0: float, wait: float) -> None:
        """Charge the time since t0 to the kind of `batch` (the step launched, or read back when
        none was launched); decode_host_s gets the part not spent waiting for the device."""
        elapsed = time.perf_counter() - t0
        kind = "decode" if not batch.is_prefill else "mixed" if batch.is_mixed else "prefill"
        self.stats[f"{kind}_s"] += elapsed
        if kind == "decode":
            self.stats["decode_host_s"] += elapsed - wait
