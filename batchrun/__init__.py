"""batchrun: offline batch inference for LLMs with LoRA adapters."""
__version__ = "0.1.0"
