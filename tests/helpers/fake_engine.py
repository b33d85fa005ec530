"""A unit-test double of batchrun.engine.engine.Engine with its interface (``from_spec``,
``tokenizer``, ``check_request``, ``generate``, ``generate_stream``) and the demo's behaviour:
base copies the prompt, ``reverse`` reverses it, ``upper`` upper-cases it, so job-side tests check
exact strings in milliseconds. It uses the model dir's real tokenizer.

``generate_stream`` streams as the real engine does: it holds at most ``batch`` requests
"running", pulls more from the source without waiting while it has some, and finishes one per
"step" (the oldest). Hooks, from the environment (they reach forked and subprocess CLIs):
    FAKE_ENGINE_EXIT_AFTER=N   os._exit(137) after N results in this process (mid-unit kill -9)
    FAKE_ENGINE_SLEEP=S        sleep S seconds per result (signal tests)
    FAKE_ENGINE_LOG=path       append one line per result: its request id and adapter
and as class attributes (in-process tests): ``kill_after`` SIGKILLs this process right after that
many streamed results, ``before_kill`` runs first (tests record the feeder's and writer's state
there); ``max_units_in_flight`` is the most distinct units among the running requests at once.
"""
from __future__ import annotations

import os
import signal
import time

from batchrun.engine.request import Result
from batchrun.engine.request_check import RequestLimits, request_problem

TRANSFORMS = {None: lambda s: s, "reverse": lambda s: s[::-1], "upper": lambda s: s.upper()}


class FakeEngine:
    results_emitted = 0  # results of this process (FAKE_ENGINE_EXIT_AFTER counts these)
    batch = 3
    kill_after = 0
    before_kill = None
    emitted = 0  # streamed results (kill_after counts these)
    max_units_in_flight = 0

    def __init__(self, spec):
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model)
        from batchrun.engine.config import context_max_model_len
        from batchrun.engine.models.config import ModelConfig
        # auto: the model's context (the fake has no KV cache to lower it to)
        self.max_model_len = context_max_model_len(spec.engine.max_model_len, ModelConfig.from_dir(spec.model))
        self.adapters = set(spec.adapters)
        self.request_limits = RequestLimits(self.max_model_len, adapters=self.adapters)

    @classmethod
    def from_spec(cls, spec):
        return cls(spec)

    def check_request(self, req, job: bool = False) -> str | None:
        return request_problem(req.prompt_token_ids, req.sampling, req.adapter, self.request_limits, job)

    def generate_stream(self, source, on_result):
        running, ended = [], False
        while True:
            if not ended and len(running) < self.batch:
                got = source.take(self.batch - len(running), wait=not running)
                if got is None:
                    ended = True
                else:
                    running += got
            if not running:
                if ended:
                    return
                continue
            units = {r.request_id[0] for r in running}
            FakeEngine.max_units_in_flight = max(FakeEngine.max_units_in_flight, len(units))
            self.generate([running.pop(0)], on_result)
            FakeEngine.emitted += 1
            if self.kill_after and FakeEngine.emitted >= self.kill_after:
                if self.before_kill is not None:
                    self.before_kill()
                os.kill(os.getpid(), signal.SIGKILL)

    def generate(self, requests, on_result=None):
        log = os.environ.get("FAKE_ENGINE_LOG")
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
            if log:
                with open(log, "a") as f:
                    f.write(f"{req.request_id} {req.adapter or None}\n")
            if sleep:
                time.sleep(sleep)
            FakeEngine.results_emitted += 1
            if exit_after and FakeEngine.results_emitted >= exit_after:
                os._exit(137)  # as abrupt as kill -9: no cleanup, no atexit, no flush
            if on_result:
                on_result(res)
            out.append(res)
        return out
