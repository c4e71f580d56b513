"""The engine's own request checks (token ids, sampling ranges); what the scheduler refuses
(empty prompt, context, pool) is in tests/model_shards/engine/scheduler/test_requests.py."""

from __future__ import annotations

import math
from typing import Any

import pytest

from model_shards.engine.request_checks import content_problem, fit_problem
from model_shards.messages import GenerateRequest, SamplingParams


def _request(prompt: list[int] | None = None, **sampling: Any) -> GenerateRequest:
    return GenerateRequest("r", [1, 2] if prompt is None else prompt, 4, SamplingParams(**sampling))


def test_a_plain_request_passes() -> None:
    assert content_problem(_request(temperature=0.7, top_p=0.9, logprobs=20), 10) is None
    assert fit_problem(_request(), max_model_len=16, block_size=4, num_blocks=2) is None


@pytest.mark.parametrize("ids", [[10], [-1], [0, 3, 99]])
def test_token_ids_outside_the_vocabulary(ids: list[int]) -> None:
    assert content_problem(_request(ids), 10) == "prompt token ids must be in [0, 10)"


@pytest.mark.parametrize(
    ("sampling", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_sampling_out_of_range_is_named(sampling: dict[str, Any], name: str) -> None:
    problem = content_problem(_request(**sampling), 10)
    assert problem is not None and problem.startswith("sampling parameters out of range")
    assert f"{name} = " in problem


@pytest.mark.parametrize("k", [-1, 21])
def test_prompt_logprobs_out_of_range(k: int) -> None:
    request = GenerateRequest("r", [1, 2], 4, prompt_logprobs=k)
    assert content_problem(request, 10) == f"prompt_logprobs = {k} must be in 0..20"
    assert content_problem(GenerateRequest("r", [1, 2], 4, prompt_logprobs=20), 10) is None
