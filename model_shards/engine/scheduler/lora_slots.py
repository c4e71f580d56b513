"""Rank 0's table of the ranks' LoRA adapter slots (``--max-loras``).

A running sequence with an adapter holds its slot; a slot nobody holds keeps its adapter (a
later request for it loads nothing) until a new adapter needs the room, least recently
released first. An adapter in use is never evicted: a request that finds every slot held
waits (admission stops at it, as for blocks).
"""

from __future__ import annotations

from collections import OrderedDict

from model_shards.messages import LoraRef


class LoraSlots:
    """Which adapter each of ``num_slots`` slots holds, and how many sequences use it."""

    def __init__(self, num_slots: int) -> None:
        self._adapter: list[LoraRef | None] = [None] * num_slots
        self._users = [0] * num_slots
        self._idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))

    def acquire(self, ref: LoraRef) -> tuple[int, bool] | None:
        """A slot for ``ref`` and whether the ranks must load it there first; ``None`` when
        every slot is held by another adapter's sequences."""
        if ref in self._adapter:
            slot = self._adapter.index(ref)
            self._idle.pop(slot, None)
            self._users[slot] += 1
            return slot, False
        if not self._idle:
            return None
        slot, _ = self._idle.popitem(last=False)
        self._adapter[slot] = ref
        self._users[slot] = 1
        return slot, True

    def release(self, slot: int) -> None:
        """A sequence stopped using ``slot`` (finished, aborted or preempted)."""
        self._users[slot] -= 1
        if self._users[slot] == 0:
            self._idle[slot] = None

    def users(self, slot: int) -> int:
        return self._users[slot]

    def holder(self, slot: int) -> LoraRef | None:
        """The adapter ``slot`` holds (loaded, or being loaded by a step in flight)."""
        return self._adapter[slot]
