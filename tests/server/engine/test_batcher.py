"""Batcher: window, size cap, cancellation before sending."""

from __future__ import annotations

import asyncio

import pytest

from model_shards.messages import GenerateRequest
from server.engine.batcher import Batcher
from tests.waiting import async_wait_until

pytestmark = pytest.mark.timeout(30)
WINDOW_S = 0.2  # far longer than one event-loop turn, even on a loaded machine
EARLY_S = 1e-3  # asyncio may run a timer up to its clock resolution early


def req(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1], max_tokens=1)


def ids(batches: list[list[GenerateRequest]]) -> list[list[str]]:
    return [[r.request_id for r in batch] for batch in batches]


async def test_requests_within_window_form_one_batch() -> None:
    loop = asyncio.get_running_loop()
    sent: list[list[GenerateRequest]] = []
    sent_at: list[float] = []

    def send(batch: list[GenerateRequest]) -> None:
        sent.append(batch)
        sent_at.append(loop.time())

    batcher = Batcher(send, window_s=WINDOW_S)
    opened = loop.time()
    batcher.submit(req("a"))
    await asyncio.sleep(0)  # b arrives in a later loop turn, inside a's window
    batcher.submit(req("b"))
    assert sent == []
    await async_wait_until(lambda: len(sent) == 1, "the first window to close")
    assert sent_at[0] - opened >= WINDOW_S - EARLY_S  # not before the window closed
    reopened = loop.time()
    batcher.submit(req("c"))
    await async_wait_until(lambda: len(sent) == 2, "the second window to close")
    assert sent_at[1] - reopened >= WINDOW_S - EARLY_S
    assert ids(sent) == [["a", "b"], ["c"]]


async def test_full_batch_flushes_at_once() -> None:
    sent: list[list[GenerateRequest]] = []
    batcher = Batcher(sent.append, window_s=10, max_batch_size=2)
    for rid in "abc":
        batcher.submit(req(rid))
    assert ids(sent) == [["a", "b"]] and batcher.pending == 1
    batcher.close()
    assert batcher.pending == 0


async def test_zero_window_groups_one_tick() -> None:
    sent: list[list[GenerateRequest]] = []
    batcher = Batcher(sent.append, window_s=0)
    batcher.submit(req("a"))
    batcher.submit(req("b"))
    await async_wait_until(lambda: len(sent) > 0, "the zero window to close")
    assert ids(sent) == [["a", "b"]]


async def test_cancel_before_send() -> None:
    sent: list[list[GenerateRequest]] = []
    batcher = Batcher(sent.append, window_s=0.02)
    batcher.submit(req("a"))
    batcher.submit(req("b"))
    assert batcher.cancel("a") and not batcher.cancel("zzz")
    await async_wait_until(lambda: len(sent) > 0, "the window to close")
    assert ids(sent) == [["b"]] and batcher.pending == 0  # "a" is not left for later


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        Batcher(lambda batch: None, window_s=-1)
    with pytest.raises(ValueError):
        Batcher(lambda batch: None, max_batch_size=0)


async def test_idle_engine_gets_the_request_on_the_next_tick() -> None:
    """Nothing on the engine: no window wait (a 10-minute window would outlast the
    test), yet requests of the same tick still travel together."""
    sent: list[list[GenerateRequest]] = []
    asked: list[int] = []

    def idle() -> bool:
        asked.append(len(sent))
        return True

    batcher = Batcher(sent.append, window_s=600, idle=idle)
    batcher.submit(req("a"))
    batcher.submit(req("b"))  # same tick: joins a's batch, does not ask again
    assert sent == [] and asked == [0]
    await asyncio.sleep(0)  # the flush was queued before this task's wake-up
    assert ids(sent) == [["a", "b"]]
    batcher.submit(req("c"))
    await asyncio.sleep(0)
    assert ids(sent) == [["a", "b"], ["c"]] and asked == [0, 1]


async def test_busy_engine_still_waits_for_the_window() -> None:
    sent: list[list[GenerateRequest]] = []
    batcher = Batcher(sent.append, window_s=600, idle=lambda: False)
    batcher.submit(req("a"))
    for _ in range(5):
        await asyncio.sleep(0)
    batcher.submit(req("b"))
    assert sent == [] and batcher.pending == 2  # batching under load is kept
    batcher.flush()
    assert ids(sent) == [["a", "b"]]
