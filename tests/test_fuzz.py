"""Fuzz every route from ``/openapi.json`` (schemathesis): no 5xx, every 4xx an OpenAI error
body, and the server lives on.

A real uvicorn server (in a background thread with its own event loop) serves
the app over the fake engine of :mod:`tests.server.fake_engine`; schemathesis
generates bodies from the declared request schemas (``max_examples`` each).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings

from server.engine.client import EngineClient
from server.http.app import build_app
from server.http.pooling_routes import POOLING_ROUTES
from server.text.tokenizer import Tokenizer
from tests.model_shards.models.classifier_checkpoints import write_bert_tokenizer
from tests.server.conftest import EOS_ID, free_socket, write_tiny_tokenizer
from tests.server.fake_classifier_engine import FakeClassifierEngine
from tests.server.fake_engine import FakeEngine
from tests.waiting import async_wait_until


@contextlib.contextmanager
def _live_app(engine: FakeEngine, tokenizer: Tokenizer) -> Iterator[str]:
    """A uvicorn server on a free port serving ``build_app`` over ``engine``: its base URL."""
    sock = free_socket()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict[str, object] = {}

    async def run() -> None:
        client = EngineClient(engine.address, is_alive=engine.is_alive)
        await client.connect(timeout_s=30)
        app = build_app(client, tokenizer, "tiny", 256)
        server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
        holder["server"] = server
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        await async_wait_until(lambda: server.started, "uvicorn to start serving", timeout=30)
        started.set()
        await task
        await client.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        holder["server"].should_exit = True  # type: ignore[attr-defined]
        thread.join(30)
        engine.stop()
        sock.close()


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = tmp_path_factory.mktemp("fuzz")
    tokenizer = Tokenizer.from_dir(write_tiny_tokenizer(Path(directory) / "tok"))
    engine = FakeEngine(
        f"ipc://{directory}/engine.sock", tokenizer.vocab_size, [EOS_ID], special_ids={0}
    ).start()
    with _live_app(engine, tokenizer) as url:
        yield url


def _fuzz(base_url: str, operations: list[Any]) -> None:
    """``max_examples`` bodies for each operation: never a 5xx."""
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
        def check(case: schemathesis.Case) -> None:
            response = case.call(base_url=base_url, timeout=30)
            assert response.status_code < 500, (case.path, case.body, response.text)
            if response.status_code >= 400:
                error = response.json().get("error")
                assert isinstance(error, dict), (case.path, case.body, response.text)
                assert set(error) == {"message", "type", "param", "code"}, response.text

        check()


@pytest.mark.timeout(600)
def test_no_5xx_on_any_route(base_url: str) -> None:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/health"} <= paths
    assert "/v1/responses/{response_id}" in paths
    bodies = {op.path for op in operations if op.body}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses"} <= bodies
    assert set(POOLING_ROUTES) <= bodies
    _fuzz(base_url, operations)
    with httpx.Client(base_url=base_url) as http:
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


@pytest.mark.timeout(300)
def test_no_5xx_on_the_classifier_routes_of_a_cross_encoder(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = tmp_path_factory.mktemp("fuzz-classifier")
    tokenizer = Tokenizer.from_dir(write_bert_tokenizer(directory / "tok"))
    engine = FakeClassifierEngine(f"ipc://{directory}/engine.sock", tokenizer.vocab_size, [])
    with _live_app(engine.start(), tokenizer) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        pooling = [op for op in operations if op.path in POOLING_ROUTES]
        assert {op.path for op in pooling} == set(POOLING_ROUTES)
        _fuzz(url, pooling)
        with httpx.Client(base_url=url) as http:
            ok = http.post("/v1/rerank", json={"query": "paris", "documents": ["a", "b c"]})
            assert ok.status_code == 200, ok.text
