"""Engine: load model (+ adapters), size the KV cache, run requests to completion.

    engine = Engine.from_config(EngineConfig(model="dir"), adapters={"name": "adapter-dir"})
    results = engine.generate([Request("a", ids, SamplingParams(max_tokens=32))])
    engine.generate_stream(source, on_result)  # requests pulled as the batch has room

A step is three calls: the scheduler plans it (`schedule`), the model runner runs it and the
sampler picks tokens on the device (`StepExecutor.execute`, steps.py), and the scheduler takes
the tokens back (`update`: append, stop checks, finish). `step()` is that, synchronously.
With async scheduling (`config.experiments.async_scheduling`) the loop runs the same three
calls overlapped, `step_async()`: schedule(n+1) -> execute(n+1) -> update(n), so the host's work
for both steps runs while the device runs step n+1 (vLLM's async scheduling).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from batchrun.engine.config import EngineConfig, context_max_model_len
from batchrun.engine.block_manager import BlockManager
from batchrun.engine.cpu_threads import limit_cpu_threads
from batchrun.engine.kv_sizing import (check_one_sequence_fits, check_weights_fit, num_kv_blocks,
                                       resolve_max_model_len, resolve_max_num_seqs)
from batchrun.engine.model_runner import ModelRunner
from batchrun.engine.request import Request, Result
from batchrun.engine.stop import finished_result
from batchrun.engine.steps import Launched, StepExecutor
from batchrun.engine.scheduler import Scheduler
from batchrun.engine.sequence import Sequence
from batchrun.engine.source import ListSource, RequestSource, as_source
from batchrun.errors import ConfigError
from batchrun.engine.request_check import RequestLimits, request_problem
from batchrun.engine.models.loader import load_model, resolve_dtype
from batchrun.engine.models.config import ModelConfig, check_context_length
from batchrun.common.tokenizer import load_tokenizer  # one loader, shared with the pre-run checks


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("engine.device: 'cuda' asked for but no CUDA GPU is visible; "
                          "use device: auto or cpu")
    return torch.device(name)


def max_position(config: EngineConfig, mcfg: ModelConfig) -> int:
    """Rotary table length: enough for max_model_len even past the trained context (auto never
    goes past it)."""
    return max(context_max_model_len(config.max_model_len, mcfg), mcfg.max_position_embeddings)


EMPTY_STEP = ("scheduler produced an empty step with work pending "
              "(KV cache too small for any waiting sequence)")


def weight_bytes(model) -> int:
    """Bytes of the model's parameters as stored (FP8 layers at one byte a weight), each
    storage counted once (a tied lm_head is the embedding table)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


class Engine:
    def __init__(self, config: EngineConfig, model, tokenizer, device, dtype, lora=None):
        config = resolve_max_model_len(model.config, config, device, dtype)
        config = resolve_max_num_seqs(model.config, config, device, dtype)
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.device, self.dtype, self.lora = device, dtype, lora
        mcfg: ModelConfig = model.config
        self.max_model_len = config.max_model_len
        self.eos_ids = set(mcfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.blocks = BlockManager(num_kv_blocks(mcfg, config, device, dtype), config.block_size,
                                   enable_caching=config.enable_prefix_caching)
        self.runner = ModelRunner(model, config, device, dtype, self.blocks, lora)
        self.request_limits = RequestLimits(
            config.max_model_len, mcfg.vocab_size, has_tokenizer=tokenizer is not None,
            adapters=None if lora is None else lora.infos, format_problem=self._format_problem)
        # steps = prefill_steps + decode_steps + mixed_steps (decode rows + prefill chunks);
        # prefix_cache_*: prompt tokens looked up at admission and found cached (not computed);
        # {prefill,decode,mixed}_s: wall time of those steps (each ends with its tokens on the
        # host), decode_host_s: the part of decode_s the host spent on its own work (planning,
        # inputs, launches, appending tokens, stop checks), not waiting for the device
        self.stats = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "mixed_steps": 0,
                      "preemptions": 0, "recomputed_tokens": 0, "prefix_cache_queried_tokens": 0,
                      "prefix_cache_hit_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0,
                      "mixed_s": 0.0, "decode_host_s": 0.0}
        self._grammars = None  # _grammar_engine(): made on first use
        self.executor = StepExecutor(self.runner, frozenset(self.eos_ids), self._grammar_engine,
                                     self.stats)

    @classmethod
    def from_config(cls, config: EngineConfig, adapters: dict[str, str] | None = None) -> "Engine":
        """Load the model directory named by config.model (and its tokenizer)."""
        device = resolve_device(config.device)
        if device.type == "cpu":
            limit_cpu_threads()
        mcfg = ModelConfig.from_dir(config.model)
        dtype = resolve_dtype(config.dtype, mcfg, device)
        if config.max_model_len != "auto":  # auto is at most the context, sized after the weights
            check_context_length(mcfg, config.max_model_len, config.model)
            check_one_sequence_fits(mcfg, config, device, dtype)  # before the rotary table and weights
        check_weights_fit(mcfg, config, device, dtype)  # a model too big says by how much
        tokenizer = load_tokenizer(config.model)
        model = load_model(config.model, device, dtype, max_position(config, mcfg),
                           config.quantization)
        return cls.from_model(config, model, tokenizer, adapters)

    @classmethod
    def from_model(cls, config: EngineConfig, model, tokenizer=None,
                   adapters: dict[str, str] | None = None) -> "Engine":
        """Wrap an already built model (e.g. random weights for benchmarks)."""
        embed = model.model.embed_tokens.weight  # the model dtype (FP8 layers hold e4m3 weights)
        device, dtype = embed.device, embed.dtype
        # before the LoRA buffers and the runner, which are sized by them (the weights are loaded,
        # so the free memory they are sized from is what the KV cache will get); max_model_len
        # first: max_num_seqs auto counts sequences of that length
        config = resolve_max_model_len(model.config, config, device, dtype)
        config = resolve_max_num_seqs(model.config, config, device, dtype)
        lora = None
        if adapters and not config.enable_lora:
            raise ConfigError("adapters were given but engine LoRA is disabled (enable_lora=False)")
        if config.enable_lora:
            from batchrun.engine.lora.manager import LoRAManager
            lora = LoRAManager(model, dict(adapters or {}), max_loras=config.max_loras,
                               max_lora_rank=config.max_lora_rank,
                               max_num_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                               max_cpu_loras=config.max_cpu_loras, device=device, dtype=dtype)
        engine = cls(config, model, tokenizer, device, dtype, lora)
        if device.type == "cuda" and not config.enforce_eager:
            engine.capture_graphs()
        return engine

    def memory_summary(self) -> str:
        """What the weights and the KV cache take, in the dtypes they are stored in (FP8
        layers at one byte a weight), for the run's log."""
        weights = weight_bytes(self.model)
        quant = self.model.config.quant
        kv = self.runner.kv_cache
        gib = 1 << 30
        return (f"weights {weights / gib:.2f} GiB ({'model dtype' if quant is None else quant.name}), "
                f"KV cache {kv.numel() * kv.element_size() / gib:.2f} GiB in {str(kv.dtype)[6:]} "
                f"({self.blocks.num_blocks} blocks of {self.config.block_size} tokens), "
                f"max_num_seqs {self.config.max_num_seqs}")

    def capture_graphs(self) -> None:
        self.runner.capture_graphs()

    # ---- requests -----------------------------------------------------------------------
    def check_request(self, req: Request, job: bool = False) -> str | None:
        """Why this request cannot run on this engine, or None (request_check.py decides;
        ``job``: name the limits as job.yaml does)."""
        return request_problem(req.prompt_token_ids, req.sampling, req.adapter, self.request_limits, job)

    def _format_problem(self, fmt: str) -> str | None:
        try:
            self._grammar_engine().compile(fmt)
        except ValueError as e:
            return str(e)
        return None

    def generate(self, requests: list[Request],
                 on_result: Callable[[Result], None] | None = None) -> list[Result]:
        """Run a list of requests to completion; results in request order (the stream over a
        list: the same steps as admitting the whole list at once)."""
        requests = list(requests)
        results: list[Result | None] = [None] * len(requests)

        def keep(index: int, res: Result) -> None:
            results[index] = res
            if on_result:
                on_result(res)
        self._run(ListSource(requests), keep)
        return results  # type: ignore[return-value]

    def generate_stream(self, source, on_result: Callable[[Result], None]) -> None:
        """Run requests pulled from ``source`` until it ends; each result goes to ``on_result``.

        ``source`` is a ``RequestSource`` (``take(n, wait)``, see ``engine/source.py``) or any
        iterable of Requests. It is pulled whenever fewer than ``max_num_seqs`` sequences wait,
        without blocking while the engine has work, so requests that arrive over time join the
        running batch: consecutive units and shards do not drain it.
        """
        self._run(as_source(source), lambda index, res: on_result(res))

    # ---- steps ----------------------------------------------------------------------------
    def scheduler(self) -> Scheduler:
        """A scheduler for one run over this engine's KV blocks, LoRA slots and stop checks."""
        return Scheduler(self.config, self.blocks, self.lora, frozenset(self.eos_ids), self.tokenizer,
                         long_rope_from=self.runner.long_rope_from)

    def step(self, sched: Scheduler) -> list[Sequence]:
        """One step, synchronously: schedule -> execute -> update. Returns the rows that
        finished."""
        t0 = time.perf_counter()
        batch = sched.schedule()
        if not batch.seqs:
            raise RuntimeError(EMPTY_STEP)
        launched = self.executor.execute(batch, None)
        finished, wait = self._update(sched, launched)
        self._time_step(batch, t0, wait)
        return finished

    def step_async(self, sched: Scheduler, prev: Launched | None
                   ) -> tuple[list[Sequence], Launched | None]:
        """One turn of the async loop: schedule(n+1) -> execute(n+1) -> update(n), where
        `prev` is step n (launched last turn, its tokens not read yet). Returns the rows that
        finished and step n+1, to pass as `prev` next turn.

        Step n+1 is planned before step n's tokens are on the host: a row's newest token is fed
        to it on the device (`ScheduledBatch.pending_rows`), a row that step n ends (EOS, stop)
        runs one step too many (update drops that token) and its KV blocks and slot free one
        step later; a row that step n ends by length is left out of step n+1. When a row's next
        step reads its tokens on the host (penalties, response_format), or nothing can be
        scheduled before step n's tokens are back, the turn is update(n) alone. Outputs are
        those of `step()`."""
        t0 = time.perf_counter()
        batch = None
        if prev is None or not prev.needs_sync:
            batch = sched.schedule()
            if not batch.seqs:
                if prev is None:
                    raise RuntimeError(EMPTY_STEP)
                batch = None  # rows that only wait to end by length: read step n back
        cur = None if batch is None else self.executor.execute(batch, prev)
        finished, wait = self._update(sched, prev)
        self._time_step(prev.batch if batch is None else batch, t0, wait)
        return finished, cur

    def _update(self, sched: Scheduler, launched: Launched | None) -> tuple[list[Sequence], float]:
        """Read a launched step's tokens back (waiting for them: the seconds waited are
        returned) and hand them to the scheduler; returns the rows that finished."""
        if launched is None:
            return [], 0.0
        t = time.perf_counter()
        out = launched.sampled.result()
        wait = time.perf_counter() - t
        return sched.update(launched.seqs, out.tokens, out.logprobs, out.top_logprobs), wait

    def _time_step(self, batch, t0: float, wait: float) -> None:
        """Charge the time since t0 to the kind of `batch` (the step launched, or read back when
        none was launched); decode_host_s gets the part not spent waiting for the device."""
        elapsed = time.perf_counter() - t0
        kind = "decode" if not batch.is_prefill else "mixed" if batch.is_mixed else "prefill"
        self.stats[f"{kind}_s"] += elapsed
        if kind == "decode":
            self.stats["decode_host_s"] += elapsed - wait

    def _run(self, source: RequestSource, emit: Callable[[int, Result], None]) -> None:
        sched = self.scheduler()
        overlap = self.config.experiments.async_scheduling
        # keep at least max_num_seqs waiting: a prefill step admits at most that many, so the
        # steps are those of a scheduler that holds every request from the start
        low = self.config.max_num_seqs
        count, ended, ok = 0, False, False
        inflight = None  # async: the step launched last turn, its tokens not read yet
        try:
            while True:
                while not ended and len(sched.waiting) < low:
                    got = source.take(2 * low - len(sched.waiting), wait=not sched.has_work())
                    if got is None:
                        ended = True
                        break
                    if not got:
                        break  # nothing ready yet: keep stepping what is running
                    for req in got:
                        index, count = count, count + 1
                        err = None if req.checked else self.check_request(req)
                        if err is not None:
                            emit(index, Result(req.request_id, req.adapter or None, len(req.prompt_token_ids),
                                               [], None, "error", err))
                            continue
                        fmt = req.sampling.response_format
                        grammar = None if fmt is None else self._grammar_engine().matcher(fmt)
                        sched.add(Sequence(index, req.request_id, req.prompt_token_ids, req.sampling,
                                           req.adapter, self._generator(req), grammar))
                if not sched.has_work():
                    if ended:
                        ok = True
                        return
                    continue  # the next take waits
                if overlap:
                    finished, inflight = self.step_async(sched, inflight)
                else:
                    finished = self.step(sched)
                for seq in finished:
                    emit(seq.index, finished_result(seq, self.tokenizer))
        finally:
            self.stats["preemptions"] += sched.num_preemptions
            self.stats["recomputed_tokens"] += sched.num_recomputed_tokens
            self.stats["prefix_cache_queried_tokens"] += sched.prefix_queried_tokens
            self.stats["prefix_cache_hit_tokens"] += sched.prefix_hit_tokens
            if not ok:
                sched.abort()

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.sampling.greedy:
            return None
        g = torch.Generator(device=self.device)
        seed = req.sampling.seed
        g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return g

    def _grammar_engine(self):
        """The xgrammar compiler for this tokenizer, made on first use (jobs without
        response_format never import xgrammar)."""
        if self._grammars is None:
            from batchrun.engine.grammar import Grammars
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.eos_ids)
        return self._grammars
