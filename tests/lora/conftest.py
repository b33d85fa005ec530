"""The LoRA tests' base model shape: tests.helpers.models' "lora_llama" (hidden 64, 2 layers, GQA)."""
import pytest

from tests.helpers.models import model_config


@pytest.fixture
def mcfg():
    return model_config()
