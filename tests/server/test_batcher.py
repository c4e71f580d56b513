"""Batcher: window, size cap, cancellation before sending."""

from __future__ import annotations

import asyncio

import pytest

from model_shards.messages import GenerateRequest
from server.batcher import Batcher

pytestmark = pytest.mark.timeout(30)


def req(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1], max_tokens=1)


def ids(batches: list[list[GenerateRequest]]) -> list[list[str]]:
    return [[r.request_id for r in batch] for batch in batches]


async def test_requests_within_window_form_one_batch() -> None:
    sent: list[list[GenerateRequest]] = []
    batcher = Batcher(sent.append, window_s=0.05)
    batcher.submit(req("a"))
    await asyncio.sleep(0.01)
    batcher.submit(req("b"))
    assert sent == []
    await asyncio.sleep(0.1)
    batcher.submit(req("c"))
    await asyncio.sleep(0.1)
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
    await asyncio.sleep(0.01)
    assert ids(sent) == [["a", "b"]]


async def test_cancel_before_send() -> None:
    sent: list[list[GenerateRequest]] = []
    batcher = Batcher(sent.append, window_s=0.02)
    batcher.submit(req("a"))
    batcher.submit(req("b"))
    assert batcher.cancel("a") and not batcher.cancel("zzz")
    await asyncio.sleep(0.05)
    assert ids(sent) == [["b"]]


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        Batcher(lambda batch: None, window_s=-1)
    with pytest.raises(ValueError):
        Batcher(lambda batch: None, max_batch_size=0)
