"""Opt-in time-to-first-token tracing on rank 0 (``GenerateRequest.trace``).

A traced request gets ``time.monotonic_ns()`` stamps until its first output: ``received``,
``admitted``, ``scheduled``, ``plan_sent``, the worker's ``forward_done``, ``lm_head_done`` and
``sampled`` (pp == 1 only; :mod:`model_shards.worker.step_trace`), then ``outputs_built``; they
return in ``RequestOutput.trace``. ``CLOCK_MONOTONIC`` is shared by a host's processes, so
:mod:`server.http.ttft_trace` lays them beside the frontend's. On a GPU the worker's stamps are
launch times: ``sampled`` includes the GPU work still queued. Each stage keeps its first stamp (a
chunked prefill shows its first chunk). Untraced requests are never stored; a step without a
traced request gets :data:`~model_shards.worker.step_trace.OFF`. Pure Python; rank 0 only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec

from model_shards.engine.scheduler.scheduler import Sequence, SeqUpdate
from model_shards.messages import GenerateRequest
from model_shards.worker.step_trace import OFF, StepTrace


class RequestTraces:
    """The stamps of the traced requests rank 0 has not answered yet."""

    def __init__(self) -> None:
        self._open: dict[str, dict[str, int]] = {}

    def open(self, request: GenerateRequest, received_ns: int) -> None:
        """An admitted ``request``: if it asks to be traced, received at ``received_ns`` and
        admitted now."""
        if request.trace:
            stamps = {"received": received_ns, "admitted": time.monotonic_ns()}
            self._open[request.request_id] = stamps

    def step(self, sequences: Iterable[Sequence]) -> StepTrace:
        """The trace of a step just scheduled to run ``sequences`` (``scheduled`` stamped now):
        :data:`OFF` unless one of them is traced."""
        if not self._open:
            return OFF
        found = (self._open.get(seq.request.request_id) for seq in sequences)
        stamps = [s for s in found if s is not None]
        if not stamps:
            return OFF
        trace = StepTrace(stamps)
        trace.stamp("scheduled")
        return trace

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
