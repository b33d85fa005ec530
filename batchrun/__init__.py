"""batchrun: offline batch inference for LLMs with LoRA adapters."""
__version__ = "0.1.0"

from batchrun import _kernels_path

_kernels_path.install()

from batchrun.api import (LLM, CompletionOutput, Logprob, LoRARequest, RequestOutput,  # noqa: E402
                          SamplingParams, run)  # (no torch until used)

__all__ = ["LLM", "SamplingParams", "LoRARequest", "CompletionOutput", "Logprob", "RequestOutput", "run", "__version__"]
