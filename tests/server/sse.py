"""Reading a server-sent-events completion stream in tests."""

from __future__ import annotations

import json
from typing import Any

import httpx


async def read_events(response: httpx.Response) -> tuple[list[dict[str, Any]], bool]:
    """All ``data:`` JSON events of ``response`` and whether ``[DONE]`` ended the stream."""
    events: list[dict[str, Any]] = []
    done = False
    async for line in response.aiter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        assert not done, "event after [DONE]"
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done
