"""A unit-test double of batchrun.engine.engine.Engine (same API), with the demo's behaviour.

base copies the prompt, `reverse` reverses it, `upper` upper-cases it, so runner tests can check
exact strings in milliseconds. It uses the model dir's real tokenizer. Crash/slowness hooks for
the kill tests come from the environment:
    FAKE_ENGINE_EXIT_AFTER=N   os._exit(137) after N results in this process (mid-unit kill -9)
    FAKE_ENGINE_SLEEP=S        sleep S seconds per result (signal tests)
    FAKE_ENGINE_LOG=path       append each generate() call's request count (batching checks)
"""
from __future__ import annotations

import os
import time

from batchrun.engine.request import Result
from batchrun.engine.request_check import RequestLimits, request_problem

TRANSFORMS = {None: lambda s: s, "reverse": lambda s: s[::-1], "upper": lambda s: s.upper()}


class FakeEngine:
    results_emitted = 0

    def __init__(self, spec):
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model)
        self.max_model_len = spec.engine.max_model_len
        self.adapters = set(spec.adapters)
        self.request_limits = RequestLimits(self.max_model_len, adapters=self.adapters)

    @classmethod
    def from_spec(cls, spec):
        return cls(spec)

    def check_request(self, req, job: bool = False) -> str | None:
        return request_problem(req.prompt_token_ids, req.sampling, req.adapter, self.request_limits, job)

    def generate(self, requests, on_result=None):
        if os.environ.get("FAKE_ENGINE_LOG"):
            with open(os.environ["FAKE_ENGINE_LOG"], "a") as f:
                f.write(f"{len(requests)}\n")
        exit_after = int(os.environ.get("FAKE_ENGINE_EXIT_AFTER", "0"))
        sleep = float(os.environ.get("FAKE_ENGINE_SLEEP", "0"))
        out = []
        for req in requests:
            err = None if req.checked else self.check_request(req)
            if err:
                res = Result(req.request_id, req.adapter, len(req.prompt_token_ids), [], None, "error", err)
            else:
                prompt = self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=True)
                text = TRANSFORMS[req.adapter or None](prompt)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                reason = "stop"
                if len(ids) > req.sampling.max_tokens:
                    ids, reason = ids[:req.sampling.max_tokens], "length"
                res = Result(req.request_id, req.adapter, len(req.prompt_token_ids), ids,
                             self.tokenizer.decode(ids, skip_special_tokens=True), reason)
            if sleep:
                time.sleep(sleep)
            FakeEngine.results_emitted += 1
            if exit_after and FakeEngine.results_emitted >= exit_after:
                os._exit(137)  # as abrupt as kill -9: no cleanup, no atexit, no flush
            if on_result:
                on_result(res)
            out.append(res)
        return out
