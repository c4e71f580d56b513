"""Request validation: what constructs, what is refused, and the normalised values."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from model_shards.messages import SamplingParams
from server.api.chat_protocol import ChatCompletionRequest
from server.api.completion_protocol import CompletionRequest
from server.http.errors import validation_error


def parse(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", **fields})


def test_defaults_and_sampling() -> None:
    request = parse(prompt="hi")
    assert request.max_tokens == 16 and request.stop_strings == [] and not request.stream
    params = request.sampling_params(request.logprobs)
    assert params == SamplingParams()
    request = parse(prompt="hi", temperature=0, top_p=0.5, top_k=-1, seed=3, logprobs=2)
    params = request.sampling_params(request.logprobs)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.5, 0, 3)
    assert params.logprobs == 2
    request = parse(
        prompt="hi",
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=-0.5,
        frequency_penalty=1.5,
        min_tokens=3,
    )
    params = request.sampling_params(None)
    assert (params.min_p, params.repetition_penalty, params.min_tokens) == (0.1, 1.2, 3)
    assert (params.presence_penalty, params.frequency_penalty) == (-0.5, 1.5)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        ([1, 2], [[1, 2]]),
        (["hi"], ["hi"]),
        ([[3, 4]], [[3, 4]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_shapes(prompt: Any, expected: Any) -> None:
    assert parse(prompt=prompt).prompts == expected


def test_stop_normalised_and_extras_ignored() -> None:
    request = parse(prompt="hi", stop="x", user="u", some_future_field=1)
    assert request.stop_strings == ["x"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": ["a"] * 33}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "x", "suffix": "s"}, "suffix"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "min_p": -0.1}, "min_p"),
        ({"prompt": "x", "presence_penalty": 2.01}, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {"five": 1.0}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ],
)
def test_invalid_fields_name_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(fields)
    error = validation_error(list(info.value.errors()))
    assert error.status_code == 400
    assert error.info.param == param and param in error.info.message
    assert error.info.type == "invalid_request_error"
    assert "pydantic" not in error.info.message and "[type=" not in error.info.message


def test_max_tokens_0_needs_echo() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0})
    assert "only with echo" in validation_error(list(info.value.errors())).info.message
    request = parse(prompt="x", max_tokens=0, echo=True, logprobs=1, prompt_logprobs=3)
    assert request.echo_only and request.engine_prompt_logprobs == 3
    assert parse(prompt="x", echo=True, logprobs=2).engine_prompt_logprobs == 2
    assert parse(prompt="x", logprobs=2).engine_prompt_logprobs is None


@pytest.mark.parametrize("extra", [{"stream": True}, {"prompt_logprobs": 21}])
def test_chat_prompt_logprobs_bounds_and_no_stream(extra: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, **extra}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    error = validation_error(list(info.value.errors()))
    assert error.info.param == "prompt_logprobs"


def test_best_of_equal_to_n_is_accepted() -> None:
    assert parse(prompt="x", n=3, best_of=3).n == 3
