"""HTTP side: model discovery, ``/tokenize``, and one streamed request measured.

Works against any OpenAI-compatible server (shardserve, vLLM, TGI, ``transformers
serve``): only ``GET /v1/models``, ``POST /v1/completions`` or
``POST /v1/chat/completions`` with ``stream: true`` are required; ``POST /tokenize``
(vLLM's) is used when present.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from deploy.loadtest_lib.config import Endpoint
from deploy.loadtest_lib.records import OK, RequestRecord
from deploy.loadtest_lib.workload import RequestSpec

ERROR_TEXT_LIMIT = 300


def normalize_base_url(url: str) -> str:
    """``http://host:8000/v1/`` and ``http://host:8000`` both become ``http://host:8000``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def make_client(base_url: str, api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    """A client with no connection-pool cap (the load shape, not httpx, limits concurrency)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=normalize_base_url(base_url),
        headers=headers,
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


async def discover_model(client: httpx.AsyncClient) -> str:
    """The first model id of ``GET /v1/models``; ``RuntimeError`` saying why if there is none."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise RuntimeError(f"GET /v1/models failed ({type(exc).__name__}: {exc})") from exc
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/models answered {response.status_code}: {response.text[:200]}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError("GET /v1/models listed no model; pass --model") from None


async def count_tokens(client: httpx.AsyncClient, model: str, prompt: str) -> int | None:
    """Prompt length per the server's ``POST /tokenize`` (vLLM's); ``None`` if unavailable."""
    try:
        response = await client.post("/tokenize", json={"model": model, "prompt": prompt})
        if response.status_code != 200:
            return None
        tokens = response.json()["tokens"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return len(tokens) if isinstance(tokens, list) else None


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how requests go. ``extra_body`` is merged last into every body."""

    model: str
    endpoint: Endpoint
    ignore_eos: bool = True
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        """The JSON body: streamed, usage requested, output length fixed by ``ignore_eos``."""
        body: dict[str, Any] = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "completions":
            body["prompt"] = spec.prompt
            body["max_tokens"] = spec.output_len
        else:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
            body["max_completion_tokens"] = spec.output_len
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


def _chunk_text(chunk: Mapping[str, Any], endpoint: Endpoint) -> bool:
    """Whether an SSE chunk carries generated text (role-only and usage chunks do not)."""
    for choice in chunk.get("choices") or ():
        if endpoint == "completions":
            if choice.get("text"):
                return True
        else:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                return True
    return False


async def stream_request(
    client: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    record: RequestRecord,
    timeout_s: float,
    t0: float,
) -> None:
    """Send ``spec`` once (never retried) and fill ``record`` while it streams.

    Returns normally for every outcome, failures included (``record.status`` says which);
    only ``asyncio.CancelledError`` propagates, leaving ``record.status`` as it was.
    ``t0`` is the point's start on the ``time.perf_counter`` clock.
    """
    start = time.perf_counter()
    record.start_s = start - t0
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", target.path, json=target.body(spec)) as response:
                if response.status_code != 200:
                    raw = await response.aread()
                    record.status = f"http_{response.status_code}"
                    record.error = raw[:ERROR_TEXT_LIMIT].decode(errors="replace")
                    return
                if not await _read_events(response, target.endpoint, record, start):
                    return
        _finish(record, start, time.perf_counter())
    except TimeoutError:
        record.status, record.error = "timeout", f"no complete answer within {timeout_s:g} s"
    except httpx.TimeoutException as exc:
        record.status, record.error = "timeout", f"{type(exc).__name__}: {exc}"
    except httpx.ConnectError as exc:
        record.status, record.error = "connect", str(exc)[:ERROR_TEXT_LIMIT]
    except httpx.HTTPError as exc:
        record.status, record.error = "transport", f"{type(exc).__name__}: {exc}"
    except (ValueError, TypeError, KeyError) as exc:
        record.status, record.error = "protocol", f"{type(exc).__name__}: {exc}"[:ERROR_TEXT_LIMIT]


async def _read_events(
    response: httpx.Response, endpoint: Endpoint, record: RequestRecord, start: float
) -> bool:
    """Fill ``record`` from the SSE stream until ``[DONE]`` or its end.

    ``False`` (``record.status`` set) on an ``error`` event; ``ValueError`` on data
    that is not a JSON object.
    """
    last: float | None = None
    async for line in response.aiter_lines():
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"SSE data is not a JSON object: {data[:80]}")
        if "error" in chunk:
            record.status = "stream_error"
            record.error = json.dumps(chunk["error"])[:ERROR_TEXT_LIMIT]
            return False
        if _chunk_text(chunk, endpoint):
            if last is None:
                record.ttft_ms = (now - start) * 1000.0
            else:
                record.itl_ms.append((now - last) * 1000.0)
            last = now
            record.chunks += 1
        _record_usage(chunk.get("usage"), record)
    return True


def _record_usage(usage: object, record: RequestRecord) -> None:
    """Take the token counts of a ``usage`` object that reports ``completion_tokens``."""
    if isinstance(usage, dict) and "completion_tokens" in usage:
        record.usage_reported = True
        record.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            record.prompt_tokens = int(usage["prompt_tokens"])


def _finish(record: RequestRecord, start: float, end: float) -> None:
    """A stream that ended: ``ok`` with its end-to-end time, or ``protocol`` if it had no text."""
    if record.chunks == 0:
        record.status = "protocol"
        record.error = "the stream carried no text (is streaming supported?)"
        return
    if not record.usage_reported:
        record.output_tokens = record.chunks
    record.e2e_ms = (end - start) * 1000.0
    record.status = OK


_SPEC_SERIES = ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total")


async def spec_decode_totals(client: httpx.AsyncClient) -> tuple[float, float, float] | None:
    """The server's speculative-decoding totals from ``GET /metrics`` (shardserve's or vLLM's
    ``spec_decode`` counters): drafts, draft tokens, accepted tokens; ``None`` if it has none."""
    try:
        response = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    found: dict[str, float] = {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        for series in _SPEC_SERIES:
            if name in (f"shardserve_spec_decode_{series}", f"vllm:spec_decode_{series}"):
                found[series] = found.get(series, 0.0) + float(value)
    if len(found) < len(_SPEC_SERIES):
        return None
    drafts, tokens, accepted = (found[s] for s in _SPEC_SERIES)
    return drafts, tokens, accepted
