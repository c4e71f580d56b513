"""A fake OpenAI-compatible server with known timings, run by uvicorn in a subprocess.

A subprocess, not a thread: sharing the client's GIL would add up to a switch
interval (5 ms) to every measured gap.


``/v1/completions`` and ``/v1/chat/completions`` stream ``max_tokens`` (or
``max_completion_tokens``) chunks of one token each: the first after ``ttft_s``, the
rest ``itl_s`` apart, then a usage chunk when asked for, then ``[DONE]``. Chat sends
a role-only chunk at once (no text: must not count as the first token). With a
``fail_pattern``, the n-th generation request (0-based) is answered with the status
``fail_pattern[n % len]`` instead, when that is not ``None``. A request body may
override the delays with ``fake_ttft_s`` / ``fake_itl_s``. ``GET /_seen`` tells
what the server received: ``{"generation_requests": n, "bodies": [...]}``.
``/tokenize`` (when ``tokenizer``) counts a BOS plus one token per word, two for words
longer than five letters, and the same count is reported as ``usage.prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "fake-model"
REPO_ROOT = Path(__file__).resolve().parents[2]


def fake_token_count(prompt: str) -> int:
    return 1 + sum(2 if len(word) > 5 else 1 for word in prompt.split())


@dataclass
class FakeOpenAI:
    """Behaviour knobs, and what the server saw (``generation_requests``, ``bodies``)."""

    ttft_s: float = 0.05
    itl_s: float = 0.02
    tokenizer: bool = False
    fail_pattern: tuple[int | None, ...] = ()
    generation_requests: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/_seen", self._seen, methods=["GET"]),
            ]
        )

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _seen(self, request: Request) -> Response:
        return JSONResponse(
            {"generation_requests": self.generation_requests, "bodies": self.bodies}
        )

    async def _tokenize(self, request: Request) -> Response:
        if not self.tokenizer:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await request.json()
        return JSONResponse({"tokens": list(range(fake_token_count(body["prompt"])))})

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        if body.get("warmup"):  # ``running`` warms the streaming path up; not counted
            return StreamingResponse(self._stream(body, 0.0, 0.0), media_type="text/event-stream")
        n = self.generation_requests
        self.generation_requests += 1
        self.bodies.append(body)
        status = self.fail_pattern[n % len(self.fail_pattern)] if self.fail_pattern else None
        if status is not None:
            error = {"error": {"message": f"injected {status}", "type": "fake", "code": status}}
            return JSONResponse(error, status_code=status)
        ttft_s = float(body.get("fake_ttft_s", self.ttft_s))
        stream = self._stream(body, ttft_s, float(body.get("fake_itl_s", self.itl_s)))
        return StreamingResponse(stream, media_type="text/event-stream")

    async def _stream(
        self, body: dict[str, Any], ttft_s: float, itl_s: float
    ) -> AsyncIterator[str]:
        chat = "messages" in body
        n_tokens = int(body.get("max_completion_tokens") or body["max_tokens"])
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if chat:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await asyncio.sleep(ttft_s)
        for k in range(n_tokens):
            if k:
                await asyncio.sleep(itl_s)
            finish = "length" if k == n_tokens - 1 else None
            text = f" t{k}"
            choice: dict[str, Any] = (
                {"index": 0, "delta": {"content": text}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": text, "finish_reason": finish}
            )
            yield _sse({"choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": fake_token_count(prompt), "completion_tokens": n_tokens}
            yield _sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def seen(base_url: str) -> dict[str, Any]:
    """What the fake at ``base_url`` has received so far (see ``GET /_seen``)."""
    data: dict[str, Any] = httpx.get(f"{base_url}/_seen").json()
    return data


@contextmanager
def running(fake: FakeOpenAI) -> Iterator[str]:
    """Serve ``fake`` on a free local port in a child process; yields its base URL."""
    knobs = {
        "ttft_s": fake.ttft_s,
        "itl_s": fake.itl_s,
        "tokenizer": fake.tokenizer,
        "fail_pattern": list(fake.fail_pattern),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.deploy.fake_openai", json.dumps(knobs)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())  # the child prints its port once listening
        url = f"http://127.0.0.1:{port}"
        warmup = {"warmup": True, "prompt": "hi", "max_tokens": 2, "stream": True}
        for _ in range(3):  # the first requests of a fresh process are tens of ms slower
            httpx.post(f"{url}/v1/completions", json=warmup, timeout=20).raise_for_status()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _serve(knobs: dict[str, Any]) -> None:
    knobs["fail_pattern"] = tuple(knobs["fail_pattern"])
    fake = FakeOpenAI(**knobs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", lifespan="off"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
