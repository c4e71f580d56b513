"""End to end: ``shardserve serve --speculative-config`` (n-gram) answers greedy requests with
exactly the tokens of decoding without speculation (transformers' greedy loop on the same
weights), at ``-tp 1`` (whole answers, ``usage`` counting every token) and ``-tp 2``
(streamed); ``/metrics`` shows that verify steps ran. A draft model (the target as its own
draft, at ``-tp 1``) gives the same answers, and ``/metrics`` shows its drafts accepted."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.checkpoints import build_tiny_llama, hf_greedy
from tests.live_server import TEST_DEVICE, live_server
from tests.server.prometheus import samples

NEW_TOKENS = 20
MOTIF = [11, 22, 33, 44, 55]
# the last prompt holds a fifth of the vocabulary: the model's tokens keep recurring in it
PROMPTS = [MOTIF * 3, [7, 8, 9, 7, 8, 9, 7, 8], [42], list(range(3, 1000, 5))]
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


async def _complete(client: httpx.AsyncClient, prompt: list[int], stream: bool) -> str:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["usage"]["completion_tokens"] == NEW_TOKENS
        return str(data["choices"][0]["text"])
    text = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


async def _run_all(url: str, stream: bool) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return list(await asyncio.gather(*(_complete(client, p, stream) for p in PROMPTS)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("spec") / "llama", sharded=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = [
        tokenizer.decode(hf_greedy(model_dir, p, NEW_TOKENS), skip_special_tokens=True)
        for p in PROMPTS
    ]
    return model_dir, expected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, 2])
def test_ngram_speculation_keeps_greedy_output(
    tiny: tuple[Path, list[str]], tmp_path: Path, tp: int
) -> None:
    if TEST_DEVICE == "cuda" and torch.cuda.device_count() < tp:
        pytest.skip(f"tp={tp} on CUDA needs {tp} GPUs")
    model_dir, expected = tiny
    args = ["--model", str(model_dir), "-tp", str(tp), "--dtype", "float32"]
    with live_server([*args, "--speculative-config", json.dumps(SPEC)], tmp_path) as server:
        assert asyncio.run(_run_all(server.url, stream=tp == 2)) == expected
        got = samples(httpx.get(f"{server.url}/metrics", timeout=30).text)
    drafts = got[("shardserve_spec_decode_num_drafts_total", ())]
    draft_tokens = got[("shardserve_spec_decode_num_draft_tokens_total", ())]
    assert drafts > 0 and draft_tokens >= drafts


@pytest.mark.timeout(240)
def test_draft_model_speculation_keeps_greedy_output(
    tiny: tuple[Path, list[str]], tmp_path: Path
) -> None:
    model_dir, expected = tiny
    spec = json.dumps({"model": str(model_dir), "num_speculative_tokens": 3})
    args = ["--model", str(model_dir), "--dtype", "float32", "--speculative-config", spec]
    with live_server(args, tmp_path) as server:
        assert asyncio.run(_run_all(server.url, stream=False)) == expected
        got = samples(httpx.get(f"{server.url}/metrics", timeout=30).text)
    draft_tokens = got[("shardserve_spec_decode_num_draft_tokens_total", ())]
    accepted = got[("shardserve_spec_decode_num_accepted_tokens_total", ())]
    assert draft_tokens > 0 and accepted >= 0.9 * draft_tokens, (accepted, draft_tokens)
