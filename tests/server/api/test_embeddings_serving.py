"""``/v1/embeddings`` gets what generation has: shedding (429), ``--request-timeout`` (504,
aborted), draining (503) and request metrics, on a fake encoder replica."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.http.lifecycle import Lifecycle
from server.http.limits import Admission
from tests.server.conftest import Served, ServeFactory
from tests.server.fake_embedding_engine import FakeEmbeddingEngine, fake_vector
from tests.server.prometheus import samples
from tests.waiting import async_wait_until

pytestmark = pytest.mark.timeout(60)


async def serve_embeddings(serve: ServeFactory, **options: Any) -> Served:
    served: Served = await serve(engine_class=FakeEmbeddingEngine, **options)
    return served


def embedding(served: Served, token_lists: list[list[int]]) -> asyncio.Future[Any]:
    """POST ``token_lists`` as ``input``, started at once."""
    body = {"input": token_lists, "model": "tiny"}
    return asyncio.ensure_future(served.http.post("/v1/embeddings", json=body))


async def test_queued_requests_limit_refuses_embeddings_with_429(serve: ServeFactory) -> None:
    served = await serve_embeddings(
        serve, hold=True, app_options={"admission": Admission(max_requests=1)}
    )
    slow = embedding(served, [[5, 6]])
    await async_wait_until(lambda: len(served.engine.queued_ids) == 1, "the first input queued")
    refused = await embedding(served, [[7]])
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_overloaded"
    served.engine.release()
    assert (await slow).status_code == 200
    assert (await embedding(served, [[7]])).status_code == 200  # the slot came back


async def test_queued_tokens_limit_counts_embedding_input_tokens(serve: ServeFactory) -> None:
    served = await serve_embeddings(
        serve, hold=True, app_options={"admission": Admission(max_tokens=15)}
    )
    slow = embedding(served, [[5] * 6, [6] * 4])  # 10 input tokens outstanding
    await async_wait_until(lambda: len(served.engine.queued_ids) == 2, "both inputs queued")
    refused = await embedding(served, [[7] * 6])  # 10 + 6 > 15
    assert refused.status_code == 429 and "max-queued-tokens" in refused.text
    fits = embedding(served, [[7] * 5])  # 10 + 5 <= 15
    await async_wait_until(lambda: len(served.engine.queued_ids) == 3, "the fitting input queued")
    served.engine.release()
    assert (await fits).status_code == 200
    assert (await slow).status_code == 200


async def test_request_timeout_is_504_and_aborts_queued_inputs(serve: ServeFactory) -> None:
    served = await serve_embeddings(serve, hold=True, app_options={"request_timeout_s": 0.3})
    r = await embedding(served, [[5, 6], [7]])
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "request_timeout"
    await async_wait_until(lambda: len(served.engine.aborted) == 2, "both inputs aborted")
    assert served.engine.queued_ids == [] and served.engine.embedded == []
    assert served.client.num_pending == 0


async def test_late_result_of_a_timed_out_input_is_dropped(serve: ServeFactory) -> None:
    served = await serve_embeddings(
        serve, hold=True, drops_aborted=False, app_options={"request_timeout_s": 0.2}
    )
    late = await embedding(served, [[5, 6, 7]])
    assert late.status_code == 504, late.text
    await async_wait_until(lambda: len(served.engine.aborted) == 1, "the abort")
    served.engine.release()  # answered anyway, before the next request's answer
    r = await embedding(served, [[9]])
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["embedding"] == fake_vector([9])
    assert len(served.engine.embedded) == 2
    assert served.client.num_pending == 0 and served.client.healthy


async def test_draining_refuses_new_embeddings_and_finishes_those_in_flight(
    serve: ServeFactory,
) -> None:
    lifecycle = Lifecycle()
    served = await serve_embeddings(serve, hold=True, app_options={"lifecycle": lifecycle})
    in_flight = embedding(served, [[5, 6]])
    await async_wait_until(lambda: len(served.engine.queued_ids) == 1, "the input queued")
    lifecycle.start_draining()
    refused = await embedding(served, [[7]])
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "shutting_down"
    assert lifecycle.in_flight == 1
    served.engine.release()
    finished = await in_flight
    assert finished.status_code == 200
    assert finished.json()["data"][0]["embedding"] == fake_vector([5, 6])
    assert await lifecycle.wait_idle(5.0)


async def test_embedding_request_metrics(serve: ServeFactory) -> None:
    served = await serve_embeddings(serve, app_options={"request_timeout_s": 0.5})
    ok = [await embedding(served, lists) for lists in ([[5, 6]], [[7] * 3, [8] * 4])]
    assert [r.status_code for r in ok] == [200, 200]
    usage = sum(r.json()["usage"]["prompt_tokens"] for r in ok)
    assert (await embedding(served, [[]])).status_code == 400
    served.engine.hold = True
    assert (await embedding(served, [[9]])).status_code == 504

    got = samples((await served.http.get("/metrics")).text)

    def count(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    http = "shardserve_http_requests_total"
    assert count(http, route="/v1/embeddings", status="200") == 2
    assert count(http, route="/v1/embeddings", status="400") == 1
    assert count(http, route="/v1/embeddings", status="504") == 1
    assert count("shardserve_prompt_tokens_total") == usage + 1 == 10
    assert count("shardserve_e2e_request_latency_seconds_count") == 4  # one per input
    finished = "shardserve_sequences_finished_total"
    assert count(finished, finish_reason="embedded") == 3
    assert count(finished, finish_reason="cancelled") == 1
    assert count("shardserve_num_requests_waiting") == 0
