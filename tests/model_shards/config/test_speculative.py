"""``SpeculativeConfig.parse``: vLLM's defaults for the prompt-lookup bounds."""

from __future__ import annotations

import pytest

from model_shards.config.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig


@pytest.mark.parametrize(
    ("extra", "bounds"),
    [("", (5, 5)), (', "prompt_lookup_max": 3', (3, 3)), (', "prompt_lookup_min": 2', (2, 2))],
)
def test_lookup_bounds_default_as_in_vllm(extra: str, bounds: tuple[int, int]) -> None:
    spec = SpeculativeConfig.parse(f'{{"method": "ngram", "num_speculative_tokens": 4{extra}}}')
    assert (spec.prompt_lookup_max, spec.prompt_lookup_min) == bounds
    assert spec.num_speculative_tokens == 4
    assert spec.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE


def test_a_model_without_method_is_a_draft() -> None:
    spec = SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 2}')
    assert (spec.method, spec.model) == ("draft_model", "/m")
