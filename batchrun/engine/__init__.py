"""The engine side: a model, its KV cache and LoRA slots, a scheduler that streams requests
through prefill and decode steps, two CUDA-graph sets (docs/ARCHITECTURE.md). Kernels:
batchrun.kernels (the top-level kernels/ folder)."""
