"""A sequence: one request's tokens, its KV blocks and its progress through prefill/decode."""
from __future__ import annotations

import enum

import torch

from batchrun.engine.config import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, index: int, request_id, prompt_token_ids: list[int],
                 sampling: SamplingParams, adapter: str | None, generator: torch.Generator | None,
                 grammar=None):
        self.index = index  # order in which the engine took it (position in a generate() list)
        self.request_id = request_id
        self.adapter = adapter or None
        self.sampling = sampling
        self.token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.num_computed = 0  # tokens whose K/V are in the cache
        # LongRoPE models: rotated with the long table (the sequence is longer than the
        # pretraining length; Scheduler.add and _switch_to_long_rope set it)
        self.long_rope = False
        self.block_ids: list[int] = []
        # prefix caching (block_manager.py): hashes of the full blocks of token_ids, kept across
        # preemption (the tokens only grow), and how many of block_ids are registered
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.lora_slot = -1
        self.generator = generator  # per-row RNG: sampled tokens independent of batch-mates
        self.num_preemptions = 0
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it
        self.logprobs: list[float] = []  # sampling.logprobs: each output token's logprob ...
        self.top_logprobs: list[list[tuple[int, float]]] = []  # ... and the top k (id, logprob)
        self.grammar = grammar  # sampling.response_format: this row's xgrammar matcher (engine/grammar.py)
        # tokens sampled on the device but not yet read back into token_ids (the scheduler
        # counts one at schedule time, update takes it back; at most one when a step is
        # planned), and the row of the latest scheduled step's sampled tokens that holds this
        # row's newest one (the next step's input id, read on the device by async steps)
        self.num_pending = 0
        self.pending_row = -1
        self.preempted_computed = 0  # num_computed when last preempted (see Scheduler.finish)

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, the ones still on their way from the device included."""
        return len(self.token_ids) + self.num_pending

    @property
    def output_ids(self) -> list[int]:
        """The outputs known on the host."""
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def needs_prefill(self) -> bool:
        # in decode, exactly the last sampled token is not yet in the cache
        return self.num_tokens - self.num_computed > 1

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: drop the cache; prompt + outputs so far are prefilled again."""
        self.num_computed = 0
        self.block_ids = []
        self.num_cached_blocks = 0
        self.status = SeqStatus.WAITING
        self.num_preemptions += 1
