"""What the engine takes (Request) and gives back (Result)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from batchrun.engine.config import SamplingParams


@dataclass
class Request:
    request_id: Hashable
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # None or "" = base model
    # True: the caller already ran this engine's check_request on it (rows.build_unit does), so
    # the engine does not check it again; False (the Python API's own requests): it does.
    checked: bool = False


@dataclass
class Result:
    request_id: Hashable
    adapter: str | None
    prompt_tokens: int
    output_token_ids: list[int]
    output_text: str | None
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    stop_reason: str | int | None = None  # the matched stop string or stop token id (not EOS)
    logprobs: list[float] | None = None  # sampling.logprobs set: each output token's logprob
    top_logprobs: list[list[tuple[int, float]]] | None = None  # and the top k (token id, logprob)

    @property
    def output_tokens(self) -> int:
        return len(self.output_token_ids)
