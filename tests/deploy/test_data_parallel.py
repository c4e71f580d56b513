"""``shardserve serve -dp 2``: two real replicas behind one frontend, least-loaded routing.

Eight concurrent greedy requests must all equal transformers' greedy output
(whichever replica served them), both replicas must have served some
(``shardserve_replica_requests_total{replica=...}`` in ``/metrics``), and
SIGTERM must leave no process behind (:func:`tests.live_server.live_server`).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import psutil
import pytest
from transformers import AutoTokenizer

from tests.checkpoints import build_tiny_llama, hf_greedy
from tests.live_server import live_server

NEW_TOKENS = 16
PROMPTS: list[str | list[int]] = [
    "Hello world",
    "The quick brown fox",
    "Once upon a time",
    "1 2 3 4",
    [5, 6, 7],
    [300, 12, 9, 77, 1000],
    [42],
    [8, 8, 8, 8, 8, 8],
]


async def _complete(client: httpx.AsyncClient, prompt: str | list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


async def _complete_all(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return list(await asyncio.gather(*(_complete(client, p) for p in PROMPTS)))


def replica_requests(metrics: str) -> dict[str, float]:
    pattern = r'^shardserve_replica_requests_total\{replica="(\d+)"\} (\S+)$'
    return {m[0]: float(m[1]) for m in re.findall(pattern, metrics, re.MULTILINE)}


@pytest.mark.timeout(300)
def test_dp2_spreads_requests_and_matches_transformers(tmp_path: Path) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected = []
    for p in PROMPTS:
        ids = tokenizer(p)["input_ids"] if isinstance(p, str) else p
        expected.append(
            tokenizer.decode(hf_greedy(model_dir, ids, NEW_TOKENS), skip_special_tokens=True)
        )
    with live_server(["--model", str(model_dir), "-dp", "2"], tmp_path) as server:
        ranks = [
            c
            for c in psutil.Process(server.process.pid).children()
            if "spawn_main" in " ".join(c.cmdline())
        ]
        assert len(ranks) == 2  # one rank per replica
        assert "started replica 1" in server.log()
        assert asyncio.run(_complete_all(server.url)) == expected
        with httpx.Client(base_url=server.url) as http:
            assert http.get("/health").status_code == 200
            metrics = http.get("/metrics").text
        counts = replica_requests(metrics)
        assert set(counts) == {"0", "1"}, metrics
        assert sum(counts.values()) == len(PROMPTS)
        assert min(counts.values()) >= 2, counts  # spread, not all on one replica
        assert 'shardserve_replica_outstanding_tokens{replica="0"} 0.0' in metrics
