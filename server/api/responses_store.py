"""The responses kept for ``previous_response_id``, ``GET`` and ``DELETE /v1/responses/{id}``.

In memory, least recently used first out: at most ``max_responses`` entries and about
``max_bytes`` of conversation (its JSON size), whichever bound is hit first. Each entry holds
the response object and the whole conversation up to and including its output, as input
items (instructions excluded: OpenAI does not carry them over), so a chain survives the
eviction or deletion of its earlier responses, as in vLLM. Used from the event loop only.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from server.api.responses_output import ResponseObject

#: Default bounds of the store (responses, bytes of conversation JSON).
MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 256 * 2**20


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[dict[str, Any]]  # input items, the response's output last
    size: int  # bytes of the conversation's JSON


class ResponseStore:
    """A bounded LRU map from response id to :class:`StoredResponse`."""

    def __init__(
        self, max_responses: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one response")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]]) -> None:
        """Keep ``response`` (replacing one with its id); evict the least recently used."""
        size = len(json.dumps(conversation, ensure_ascii=False))
        self.delete(response.id)
        self._entries[response.id] = StoredResponse(response, conversation, size)
        self._bytes += size
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_responses or self._bytes > self.max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or ``None``."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        """Forget ``response_id``; whether it was there."""
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True
