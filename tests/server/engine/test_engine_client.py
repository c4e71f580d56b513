"""EngineClient against the fake engine, without HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest

from model_shards.messages import GenerateRequest
from server.engine.client import EngineClient, EngineDeadError, EngineRequestError
from server.http.request_context import post_in_flight
from tests.server.fake_engine import FakeEngine
from tests.waiting import async_wait_until

pytestmark = pytest.mark.timeout(60)


def req(rid: str, prompt: list[int], max_tokens: int = 3) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=max_tokens)


async def test_ready_and_generate(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine(vocab_size=50, eos_token_ids=[1], max_model_len=64)
    client = EngineClient(engine.address, is_alive=engine.is_alive)
    try:
        ready = await client.connect(timeout_s=10)
        assert (ready.vocab_size, ready.max_model_len, ready.eos_token_ids) == (50, 64, [1])
        outputs = [o async for o in client.generate(req("r1", [5, 6], max_tokens=3))]
        assert [o.new_token_ids for o in outputs] == [[5], [6], [5]]
        assert outputs[-1].finish_reason == "length" and outputs[0].num_prompt_tokens == 2
        assert client.healthy and client.num_pending == 0
    finally:
        await client.close(send_shutdown=True)
    assert engine.wait_for(lambda: engine.shutdowns == 1)


async def test_connect_timeout_and_dead_before_ready(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(vocab_size=50, eos_token_ids=[1], ready=False)
    client = EngineClient(engine.address, is_alive=engine.is_alive)
    with pytest.raises(TimeoutError):
        await client.connect(timeout_s=0.3)
    engine.stop()
    with pytest.raises(EngineDeadError):
        await client.connect(timeout_s=10)
    await client.close()


async def test_abort_while_waiting_in_batcher_never_reaches_engine(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(vocab_size=50, eos_token_ids=[1], step_s=0.05)
    client = EngineClient(engine.address, batch_window_s=5.0)  # the window outlasts the test
    await client.connect(timeout_s=10)
    busy = client.generate(req("busy", [5], max_tokens=200))  # the engine is not idle
    await anext(busy)
    stream = client.generate(req("early", [5]))
    task = asyncio.ensure_future(anext(stream))
    await async_wait_until(lambda: client._batcher.pending == 1, "'early' queued in the batcher")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await stream.aclose()
    await busy.aclose()  # aborts "busy": the engine is idle again
    await async_wait_until(lambda: client.num_pending == 0, "'busy' to be closed")
    outputs = [o async for o in client.generate(req("later", [7], max_tokens=1))]
    assert outputs[-1].new_token_ids == [7]
    assert engine.batches == [["busy"], ["later"]] and engine.aborted == ["busy"]
    await client.close()


async def test_idle_client_sends_without_the_window(
    make_engine: Callable[..., FakeEngine],
) -> None:
    """Nothing on the engine: a request is sent at once (this window outlasts the test)."""
    engine = make_engine(vocab_size=50, eos_token_ids=[1])
    client = EngineClient(engine.address, batch_window_s=600.0)
    await client.connect(timeout_s=10)
    for rid in ("first", "second"):  # one after the other: each finds the engine idle
        outputs = [o async for o in client.generate(req(rid, [5, 6], max_tokens=2))]
        assert outputs[-1].finish_reason == "length"
    assert engine.batches == [["first"], ["second"]]
    await client.close()


async def test_a_burst_of_posts_keeps_the_window(make_engine: Callable[..., FakeEngine]) -> None:
    """Another POST on its way through the front door: wait for the window to batch it."""
    engine = make_engine(vocab_size=50, eos_token_ids=[1])
    client = EngineClient(engine.address, batch_window_s=600.0)
    await client.connect(timeout_s=10)
    with post_in_flight(), post_in_flight():  # this request's and another's
        stream = client.generate(req("a", [5], max_tokens=1))
        task = asyncio.ensure_future(anext(stream))
        await async_wait_until(lambda: client._batcher.pending == 1, "'a' queued")
        for _ in range(5):
            await asyncio.sleep(0)
        assert client._batcher.pending == 1  # not sent on the next tick
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await stream.aclose()
    await client.close()
    assert engine.batches == []


async def test_refusal_and_fatal_error(make_engine: Callable[..., FakeEngine]) -> None:
    engine = make_engine(vocab_size=50, eos_token_ids=[1], refuse_token=9, step_s=0.05)
    client = EngineClient(engine.address)
    await client.connect(timeout_s=10)
    with pytest.raises(EngineRequestError, match="refused"):
        async for _ in client.generate(req("bad", [9])):
            pass
    assert client.healthy

    async def consume() -> None:
        async for _ in client.generate(req("long", [5], max_tokens=100)):
            pass

    task = asyncio.ensure_future(consume())
    assert await asyncio.to_thread(engine.wait_for, lambda: bool(engine.active_ids))
    engine.send_fatal("boom")
    with pytest.raises(EngineDeadError, match="boom"):
        await task
    assert not client.healthy and client.dead_reason is not None
    with pytest.raises(EngineDeadError):
        await anext(client.generate(req("after", [5])))
    await client.close()


async def test_healthy_is_pure_and_check_liveness_notices_death(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(vocab_size=50, eos_token_ids=[1])
    deaths: list[str] = []

    def describe() -> str:
        deaths.append("asked")
        return "rank 0 (pid 1) killed by SIGKILL"

    client = EngineClient(
        engine.address,
        is_alive=engine.is_alive,
        describe_death=describe,
        liveness_interval_s=3600,  # the watchdog stays asleep: only this test checks
    )
    try:
        await client.connect(timeout_s=10)
        assert client.check_liveness() and deaths == []
        engine.stop()
        assert client.healthy and client.dead_reason is None  # reading it polls nothing
        assert not client.check_liveness()
        assert client.dead_reason == "rank 0 (pid 1) killed by SIGKILL" and deaths == ["asked"]
        assert not client.healthy and not client.check_liveness() and deaths == ["asked"]
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await anext(client.generate(req("after", [5])))
    finally:
        await client.close()


async def test_fatal_error_after_a_rank_died_names_the_dead_rank(
    make_engine: Callable[..., FakeEngine],
) -> None:
    engine = make_engine(vocab_size=50, eos_token_ids=[1], step_s=0.05)
    ranks_alive = [True]
    client = EngineClient(
        engine.address,
        is_alive=lambda: ranks_alive[0] and engine.is_alive(),
        describe_death=lambda: "rank 3 (pid 7) killed by SIGKILL",
        liveness_interval_s=3600,
    )
    try:
        await client.connect(timeout_s=10)

        async def consume() -> None:
            async for _ in client.generate(req("long", [5], max_tokens=100)):
                pass

        task = asyncio.ensure_future(consume())
        assert await asyncio.to_thread(engine.wait_for, lambda: bool(engine.active_ids))
        ranks_alive[0] = False  # rank 3 died; rank 0, still up, reports losing a peer
        engine.send_fatal("rank 2 is gone")
        with pytest.raises(EngineDeadError, match="rank 3"):
            await task
        assert client.dead_reason == "rank 3 (pid 7) killed by SIGKILL"
    finally:
        await client.close()
