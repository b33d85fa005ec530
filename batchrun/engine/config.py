"""Engine and sampling configuration (dataclasses, validated on construction)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # per-row seed: same seed -> same tokens, whatever the batch-mates
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: fixed output length
    stop: tuple[str, ...] = ()  # stop strings (need a tokenizer): text ends before the first match
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # EOS / stop_token_ids / stop strings do not end the output before this
    presence_penalty: float = 0.0  # vLLM semantics: over output tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over prompt + output tokens (HF / vLLM)
    logprobs: int | None = None  # k: each generated token's logprob plus the top k
    response_format: str | None = None  # canonical JSON (job.response_format_json): a token mask per step

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


# max_num_seqs "auto": at most this many (engine/kv_sizing.py says why; fewer when the KV cache
# holds fewer max_model_len sequences)
AUTO_MAX_NUM_SEQS = {"cuda": 256, "cpu": 16}


@dataclass
class EngineConfig:
    model: str
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (config torch_dtype on GPU, float32 on CPU) | float32 | float16 | bfloat16
    max_num_seqs: int | str = 64  # "auto": sized from the KV cache when the engine starts (kv_sizing.py)
    max_num_batched_tokens: int = 2048  # per step; long prompts are prefilled in chunks of this size
    max_model_len: int = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gb: float = 1.0  # fixed KV budget on CPU
    num_kv_blocks: int | None = None  # explicit override (tests force preemption with a tiny budget)
    enable_lora: bool = False
    max_loras: int = 4  # GPU slots
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # LRU CPU cache size; None = keep all loaded adapters
    # GPU steps of at most this many tokens add LoRA deltas inside the kernel after each
    # projection (no LoRA launches); bigger prefill steps run shrink + expand kernels. Decode
    # steps are always fused. Same math either way; it only moves the cost. The consumers
    # work on row tiles (B read once per tile), so the fused path covers prefill steps up to
    # the throughput preset's 8192 tokens; the fused GEMM also computes every slot's shrink
    # (S*L*R extra columns), which is what a much larger max_loras x rank would pay for.
    lora_fused_max_tokens: int = 8192
    enforce_eager: bool = False
    # full KV blocks are shared by rows whose prompts start with the same tokens (same adapter);
    # outputs are the same either way, only the prefill work differs
    enable_prefix_caching: bool = True
    # one step carries the running rows' decode tokens and prompt chunks (vLLM's unified
    # scheduling; scheduler.py); False: a step is prefill or decode, never both (A/B benchmarks)
    enable_mixed_steps: bool = True
    cuda_graph_sizes: list[int] | None = None  # None = 1, 2, 4, 8, 16, 24, ... up to max_num_seqs
    seed: int = 0

    def __post_init__(self):
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"engine.device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"engine.dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if name == "max_num_seqs" and v == "auto":
                continue
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"engine.{name} must be an integer >= 1, got {v!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.lora_fused_max_tokens, int) or self.lora_fused_max_tokens < 0:
            raise ValueError(f"engine.lora_fused_max_tokens must be an integer >= 0, got "
                             f"{self.lora_fused_max_tokens!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"engine.enable_prefix_caching must be true or false, got "
                             f"{self.enable_prefix_caching!r}")
        if not isinstance(self.enable_mixed_steps, bool):
            raise ValueError(f"engine.enable_mixed_steps must be true or false, got "
                             f"{self.enable_mixed_steps!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"engine.num_kv_blocks must be >= 1, got {self.num_kv_blocks!r}")
