"""Shared test helpers, imported as ``tests.helpers.<module>``:

    models      the one tiny-model factory (random Hugging Face models in named shapes)
    tokenizer   character-level tokenizers built in memory
    adapters    PEFT LoRA adapters of those models, and the dense deltas PEFT computes
    jobs        job files, input Parquet rows, outputs, running the CLI
    fake_engine an engine double with the real streaming interface and exact expected outputs
    fake_cli    the CLI with the fake engine swapped in, plus crash points (also a script)
    faults      checks shared by the fault-injection tests
    fixtures    pytest fixtures (tiny model dir, job factories), registered by tests/conftest.py
"""
