"""Opt-in time-to-first-token tracing on rank 0 (``GenerateRequest.trace``).

A traced request gets ``time.monotonic_ns()`` stamps until its first output: ``received``,
``admitted``, ``scheduled``, ``plan_sent``, the worker's ``forward_done``, ``lm_head_done`` and
``sampled`` (pp == 1 only), then ``outputs_built``; they return in ``RequestOutput.trace``.
``CLOCK_MONOTONIC`` is shared by a host's processes, so :mod:`server.http.ttft_trace` lays them
beside the frontend's. On a GPU the worker's stamps are launch times: ``sampled`` includes the
GPU work still queued. Each stage keeps its first stamp (a chunked prefill shows its first
chunk). Untraced requests are never stored. Pure Python; rank 0 only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import msgspec

from model_shards.engine.scheduler.scheduler import Sequence, SeqUpdate


class RequestTraces:
    """The stamps of the traced requests rank 0 has not answered yet."""

    def __init__(self) -> None:
        self._open: dict[str, dict[str, int]] = {}

    @property
    def active(self) -> bool:
        return bool(self._open)

    def open(self, request_id: str, received_ns: int) -> None:
        """Start tracing ``request_id``, received at ``received_ns`` and admitted now."""
        self._open[request_id] = {"received": received_ns, "admitted": time.monotonic_ns()}

    def mark(self, sequences: Iterable[Sequence], stage: str, at_ns: int | None = None) -> None:
        """Stamp ``stage`` (now, or ``at_ns``) on traced ``sequences`` that lack it."""
        if not self._open:
            return
        now = time.monotonic_ns() if at_ns is None else at_ns
        for seq in sequences:
            stamps = self._open.get(seq.request.request_id)
            if stamps is not None:
                stamps.setdefault(stage, now)

    def mark_all(self, sequences: Iterable[Sequence], stamps: Mapping[str, int]) -> None:
        """:meth:`mark` every ``stage → ns`` of ``stamps`` (the worker's step stamps)."""
        if self._open:
            seqs = list(sequences)
            for stage, at_ns in stamps.items():
                self.mark(seqs, stage, at_ns)

    def drop(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def attach(self, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        """``updates`` with each traced request's stamps (``outputs_built`` added) on its
        first output; the request is no longer traced after that."""
        if not self._open:
            return updates
        now = time.monotonic_ns()
        out = []
        for update in updates:
            stamps = self._open.pop(update.output.request_id, None)
            if stamps is not None:
                stamps["outputs_built"] = now
                update = SeqUpdate(
                    update.sequence, msgspec.structs.replace(update.output, trace=stamps)
                )
            out.append(update)
        return out
