"""End to end: ``shardserve serve -tp 2 -pp 2`` answers like transformers, streamed or not.

Eight concurrent greedy requests (string and token-id prompts) must produce the
text of transformers' own greedy continuation on the same weights; bad requests
get OpenAI-style 4xx errors and the server keeps serving; prompt scoring as
lm-evaluation-harness asks for it (``echo``, ``logprobs: 1``, ``max_tokens: 0``) and vLLM's
``prompt_logprobs`` give transformers' log-probabilities; SIGTERM leaves no
process behind (checked by :func:`tests.live_server.live_server`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.checkpoints import build_tiny_llama, hf_greedy, hf_prompt_logits
from tests.live_server import TEST_DEVICE, live_server

NEW_TOKENS = 24
TEXT_PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time", "1 2 3 4"]
ID_PROMPTS = [[5, 6, 7], [300, 12, 9, 77, 1000], [42], [8, 8, 8, 8, 8, 8]]


async def _complete(client: httpx.AsyncClient, prompt: str | list[int], stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["completion_tokens"] == NEW_TOKENS
        assert data["choices"][0]["finish_reason"] == "length"
        return str(data["choices"][0]["text"])
    text, done = "", False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            text += json.loads(line[6:])["choices"][0]["text"]
    assert done, "stream did not end with data: [DONE]"
    return text


async def _run_all(url: str, prompts: list[str | list[int]], stream: bool) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return list(await asyncio.gather(*(_complete(client, p, stream) for p in prompts)))


def _check_errors(url: str) -> None:
    cases = [
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ({"prompt": "hi", "model": "no-such-model"}, 404, None),
    ]
    with httpx.Client(base_url=url, timeout=60) as http:
        for body, status, param in cases:
            r = http.post("/v1/completions", json=body)
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}, error
            if param:
                assert error["param"] == param, error
        ok = http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def _check_prompt_scoring(url: str, model_dir: Path) -> None:
    """A loglikelihood batch as lm-evaluation-harness's ``local-completions`` sends it: each
    continuation's summed logprob and ``is_greedy`` (its tokens the top alternatives) are
    transformers'; then vLLM's ``prompt_logprobs`` of one prompt."""
    context = [5, 6, 7, 300, 12]
    prompts = [context + hf_greedy(model_dir, context, 3), [*context, 42, 8, 8]]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        scored = http.post(
            "/v1/completions", json={"prompt": prompts[1], "max_tokens": 1, "prompt_logprobs": 2}
        )
        assert scored.status_code == 200, scored.text
    for ids, choice, greedy in zip(prompts, choices, (True, False), strict=True):
        logp = hf_prompt_logits(model_dir, ids).log_softmax(-1)
        want = [float(logp[i - 1, ids[i]]) for i in range(len(context), len(ids))]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        got, tops = lp["token_logprobs"][len(context) :], lp["top_logprobs"][len(context) :]
        assert sum(got) == pytest.approx(sum(want), abs=1e-3)
        is_greedy = all(t == max(top.values()) for t, top in zip(got, tops, strict=True))
        assert is_greedy == greedy
    vllm = scored.json()["choices"][0]["prompt_logprobs"]
    logp = hf_prompt_logits(model_dir, prompts[1]).log_softmax(-1)
    for i in range(1, len(prompts[1])):
        own = vllm[i][str(prompts[1][i])]
        assert own["logprob"] == pytest.approx(float(logp[i - 1, prompts[1][i]]), abs=1e-3)


@pytest.mark.timeout(300)
def test_tp2_pp2_server_matches_transformers(tmp_path: Path) -> None:
    if TEST_DEVICE == "cuda" and torch.cuda.device_count() < 4:
        pytest.skip("tp=2 pp=2 on CUDA needs 4 GPUs")
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts: list[str | list[int]] = [*TEXT_PROMPTS, *ID_PROMPTS]
    expected = []
    for p in prompts:
        ids = tokenizer(p)["input_ids"] if isinstance(p, str) else p
        expected.append(
            tokenizer.decode(hf_greedy(model_dir, ids, NEW_TOKENS), skip_special_tokens=True)
        )
    args = [
        "--model",
        str(model_dir),
        "-tp",
        "2",
        "-pp",
        "2",
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
    ]
    with live_server(args, tmp_path) as server:
        assert asyncio.run(_run_all(server.url, prompts, stream=False)) == expected
        assert asyncio.run(_run_all(server.url, prompts, stream=True)) == expected
        _check_errors(server.url)
        _check_prompt_scoring(server.url, model_dir)
