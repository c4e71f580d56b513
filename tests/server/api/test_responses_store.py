"""The bounded LRU store behind ``previous_response_id``: both bounds, recency, deletion."""

from __future__ import annotations

import pytest

from server.api.responses_output import ResponseObject
from server.api.responses_store import ResponseStore


def _response(name: str) -> ResponseObject:
    return ResponseObject(id=name, status="completed", model="m")


def _item(chars: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "x" * chars}]


def test_least_recently_used_goes_first_by_count_and_by_bytes() -> None:
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    store.put(_response("a"), _item(1))
    store.put(_response("b"), _item(1))
    assert store.get("a") is not None  # now "b" is the least recently used
    store.put(_response("c"), _item(1))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    store.put(_response("big"), _item(9_990))  # over the byte bound with "a" or "c" beside it
    assert len(store) == 1 and store.get("big") is not None
    assert store.delete("big") and not store.delete("big") and len(store) == 0
    store.put(_response("huge"), _item(20_000))  # one response is kept, even over the bound
    entry = store.get("huge")
    assert entry is not None and entry.conversation == _item(20_000)
    with pytest.raises(ValueError, match="at least one"):
        ResponseStore(max_responses=0)
