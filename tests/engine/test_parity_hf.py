"""Greedy output token ids identical to transformers generate() in fp32 on CPU."""
import pytest

from tests.helpers.models import VARIANTS, greedy_matches_hf


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf(tmp_path, variant):
    greedy_matches_hf(tmp_path, variant, "cpu")
