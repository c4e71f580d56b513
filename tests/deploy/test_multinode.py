"""Multi-node for real, on one machine: two ``shardserve engine`` "nodes" form one replica.

Each node is a ``torchrun --nnodes 2`` (c10d rendezvous on 127.0.0.1 and a
free port) running its share of the ranks (tp=2: one per node; tp=2 pp=2:
two); rank 0 (node 0, whatever order the rendezvous chose) binds
``tcp://127.0.0.1:PORT``; a frontend started with
``shardserve serve --engine tcp://127.0.0.1:PORT`` spawns no rank and serves
completions through it. Greedy outputs must equal transformers' (which the
one-node run of tests/test_http_parity.py also equals). SIGTERM stops all.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import httpx
import psutil
import pytest
from transformers import AutoTokenizer

from model_shards.launch.replicas import free_port
from tests.checkpoints import build_tiny_llama, hf_greedy
from tests.deploy.multinode import engine_nodes, logs
from tests.live_server import live_server

NEW_TOKENS = 12
PROMPTS: list[str | list[int]] = ["Hello world", "The quick brown fox", [300, 12, 9, 77, 1000]]


async def _complete(url: str, prompt: str | list[int]) -> str:
    body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])


async def _complete_all(url: str) -> list[str]:
    return list(await asyncio.gather(*(_complete(url, p) for p in PROMPTS)))


def _expected(model_dir: Path) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for p in PROMPTS:
        ids = tokenizer(p)["input_ids"] if isinstance(p, str) else p
        new = hf_greedy(model_dir, ids, NEW_TOKENS)
        out.append(tokenizer.decode(new, skip_special_tokens=True))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_two_torchrun_nodes_serve_like_one(tmp_path: Path, tp: int, pp: int) -> None:
    model_dir = build_tiny_llama(tmp_path / "llama", sharded=True)
    expected = _expected(model_dir)
    rdzv, engine_port = free_port(), free_port()
    common = [
        "--model",
        str(model_dir),
        "-tp",
        str(tp),
        "-pp",
        str(pp),
        "--device",
        "cpu",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{rdzv}",
        "--rdzv-id",
        "test",
        "--engine-host",
        "127.0.0.1",
        "--engine-port",
        str(engine_port),
    ]
    nodes = [[*common, "--node-rank", str(r)] for r in range(2)]
    token = secrets.token_hex(16)  # node 0's rank 0 and the frontend share it
    with engine_nodes(nodes, tmp_path, {"SHARDSERVE_ENGINE_TOKEN": token}) as procs:
        args = ["--model", str(model_dir), "--engine", f"tcp://127.0.0.1:{engine_port}"]
        args += ["--engine-token", token]
        try:
            with live_server(args, tmp_path) as server:
                assert psutil.Process(server.process.pid).children() == []  # no rank spawned
                assert asyncio.run(_complete_all(server.url)) == expected
                with httpx.Client(base_url=server.url) as http:
                    assert http.get("/health").status_code == 200
                    metrics = http.get("/metrics").text
                assert 'shardserve_replica_requests_total{replica="0"} 3.0' in metrics
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{logs(tmp_path, 2)}") from exc
        # the frontend left without stopping the engine: it still runs
        assert all(p.poll() is None for p in procs), logs(tmp_path, 2)
    # node 0 hosts rank 0 (the coordinator), whatever order the c10d rendezvous chose
    assert "rank0 INFO rank 0 serving on" in (tmp_path / "node0.log").read_text()
