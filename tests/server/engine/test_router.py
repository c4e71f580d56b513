"""server/engine/router.py over two fake replicas: least-loaded routing, aborts, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from model_shards.messages import GenerateRequest, SamplingParams
from server.engine.client import EngineClient, EngineDeadError
from server.engine.router import Router
from server.http.metrics import Metrics
from tests.server.fake_engine import FakeEngine

GREEDY = SamplingParams(temperature=0.0)


def request(rid: str, prompt_len: int, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, list(range(2, 2 + prompt_len)), max_tokens, GREEDY, ignore_eos=True)


@contextlib.asynccontextmanager
async def two_replicas(
    tmp_path: Path, step_s: float = 0.002, heartbeat_s: float | None = None
) -> AsyncIterator[tuple[Router, list[FakeEngine], Metrics]]:
    engines = [
        FakeEngine(f"ipc://{tmp_path}/r{i}", vocab_size=400, eos_token_ids=[1], step_s=step_s)
        for i in range(2)
    ]
    for engine in engines:
        engine.start()
    metrics = Metrics()
    clients = [
        EngineClient(e.address, batch_window_s=0, heartbeat_s=heartbeat_s, heartbeat_timeout_s=1)
        for e in engines
    ]
    router = Router(clients, metrics)
    try:
        await router.connect(timeout_s=10)
        yield router, engines, metrics
    finally:
        await router.close()
        for engine in engines:
            engine.stop()


async def drain(router: Router, req: GenerateRequest) -> list[int]:
    tokens: list[int] = []
    async for output in router.generate(req):
        tokens += output.new_token_ids
    return tokens


async def test_ties_alternate_and_load_goes_to_the_lighter_replica(tmp_path: Path) -> None:
    async with two_replicas(tmp_path, step_s=0.05) as (router, engines, metrics):
        assert router.healthy and router.info is not None
        big = asyncio.create_task(drain(router, request("big", 50, 40)))  # replica 0
        await asyncio.sleep(0)
        assert router.outstanding_tokens == [90, 0]
        small = [asyncio.create_task(drain(router, request(f"s{i}", 3, 2))) for i in range(3)]
        await asyncio.sleep(0)
        assert router.outstanding_tokens[1] == 15  # all three went to the idle replica
        await asyncio.gather(*small)
        await big
        assert router.outstanding_tokens == [0, 0]
        assert list(engines[0].requests) == ["big"]
        assert sorted(engines[1].requests) == ["s0", "s1", "s2"]
        text = metrics.render().decode()
        assert 'shardserve_replica_requests_total{replica="0"} 1.0' in text
        assert 'shardserve_replica_requests_total{replica="1"} 3.0' in text
        # idle again: equal load, so requests alternate
        for i in range(4):
            await drain(router, request(f"t{i}", 2, 1))
        assert len(engines[0].requests) == 3 and len(engines[1].requests) == 5


async def test_outputs_match_a_single_client_and_close_aborts(tmp_path: Path) -> None:
    async with two_replicas(tmp_path, step_s=0.05) as (router, engines, _):
        assert await drain(router, request("a", 3, 5)) == [2, 3, 4, 2, 3]
        stream = router.generate(request("long", 3, 100))
        await anext(stream)
        await stream.aclose()  # client gone: the replica that has it aborts it
        owner = next(e for e in engines if "long" in e.requests)
        for _ in range(100):  # the abort goes out from the client's sender task
            if "long" in owner.aborted:
                break
            await asyncio.sleep(0.05)
        assert "long" in owner.aborted
        assert router.outstanding_tokens == [0, 0]


async def test_a_silent_engine_is_dead_and_skipped(tmp_path: Path) -> None:
    async with two_replicas(tmp_path, heartbeat_s=0.1) as (router, engines, _):
        engines[1].stop()
        for _ in range(50):
            if not router.healthy:
                break
            await asyncio.sleep(0.1)
        assert not router.healthy
        assert router.dead_reason is not None and router.dead_reason.startswith("replica 1 (")
        assert await drain(router, request("x", 2, 2)) == [2, 3]  # still routed to replica 0
        engines[0].stop()
        for _ in range(50):
            if not router.clients[0].healthy:
                break
            await asyncio.sleep(0.1)
        with pytest.raises(EngineDeadError):
            await drain(router, request("y", 2, 2))


async def test_replicas_of_different_models_are_refused(tmp_path: Path) -> None:
    engines = [
        FakeEngine(f"ipc://{tmp_path}/m{i}", vocab_size=400 + i, eos_token_ids=[1]).start()
        for i in range(2)
    ]
    router = Router([EngineClient(e.address) for e in engines])
    try:
        with pytest.raises(EngineDeadError, match=r"replica 1 .*serves another model"):
            await router.connect(timeout_s=10)
    finally:
        await router.close()
        for engine in engines:
            engine.stop()
