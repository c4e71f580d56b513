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
    ("fields", "sampling", "problem"),
    [
        ({"stop_token_ids": [3, 10]}, {}, "stop_token_ids token ids must be in [0, 10)"),
        ({"stop_token_ids": [-1]}, {}, "stop_token_ids token ids must be in [0, 10)"),
        ({"resume_output_ids": [2**40]}, {}, "resume_output_ids token ids must be in [0, 10)"),
        ({}, {"bad_words_token_ids": [[1], [2, 10]]}, "bad_words_token_ids token ids must be"),
        ({}, {"bad_words_token_ids": [[1], []]}, "bad_words_token_ids: every bad word needs"),
        ({}, {"logit_bias": {2**63: 1.0}}, "logit_bias token ids must be in [0, 10)"),
        ({}, {"allowed_token_ids": [1, 2**64 - 1]}, "allowed_token_ids token ids must be in"),
        ({}, {"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"max_tokens": 2**31}, {}, "max_tokens must be at most"),
        ({"resume_output_ids": [1, 2, 3, 4]}, {}, "resume_output_ids: a replayed request"),
    ],
)
def test_every_token_id_field_is_checked(
    fields: dict[str, Any], sampling: dict[str, Any], problem: str
) -> None:
    """The ids a sampler or an embedding table indexes with, whatever field carries them."""
    request = GenerateRequest(
        "r", [1, 2], fields.pop("max_tokens", 4), SamplingParams(**sampling), **fields
    )
    found = content_problem(request, 10)
    assert found is not None and found.startswith(problem), found


def test_replayed_output_counts_against_the_context() -> None:
    request = GenerateRequest("r", [1, 2], 40, resume_output_ids=[3] * 14)
    problem = fit_problem(request, max_model_len=16, block_size=4, num_blocks=8)
    assert problem is not None and "replayed output" in problem


@pytest.mark.parametrize(
    ("sampling", "name"),
    [
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty"),
        ({"temperature": math.inf}, "temperature"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"top_k": 2**62}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"seed": 2**64 - 1}, "seed"),
        ({"logit_bias": {1: math.nan}}, "logit_bias"),
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
