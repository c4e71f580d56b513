"""One step's TTFT stamps on rank 0: the hook the worker calls at the step's phase boundaries.

Rank 0's coordinator hands :meth:`Worker.execute` the step's trace
(:meth:`model_shards.engine.request_trace.RequestTraces.step`); the worker calls it three times:
:meth:`StepTrace.forward` around its stage's forward (``forward_done`` at the end, and
meanwhile :mod:`model_shards.worker.layer_timer` hooks time each layer kind), then
:meth:`StepTrace.stamp` after the LM head (``lm_head_done``) and after sampling (``sampled``).
Each stamp (``time.monotonic_ns()``; ``layer:<kind>``: that kind's forward ns) goes to every
traced request of the step that lacks it. :data:`OFF`, the trace of every other step and of
every other rank, does nothing and allocates nothing: an untraced step runs without hooks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from model_shards.worker import layer_timer

_NOTHING: AbstractContextManager[None] = nullcontext()  # reusable: OFF's forward


class StepTrace:
    """Stamps for the traced requests of one step: each of ``stamps`` is one request's
    ``stage → ns``, of which every stage keeps its first stamp."""

    def __init__(self, stamps: list[dict[str, int]]) -> None:
        self._stamps = stamps

    def stamp(self, stage: str) -> None:
        """``stage`` ended now."""
        self._add({stage: time.monotonic_ns()})

    def forward(self, model: Any) -> AbstractContextManager[None]:
        """Around the stage's forward of ``model`` (a ``*ForCausalLM``): each layer kind's
        forward ns, and ``forward_done`` when the block ends without an error."""
        return self._timed(model)

    @contextmanager
    def _timed(self, model: Any) -> Iterator[None]:
        kinds: dict[str, int] = {}
        with layer_timer.timed(model, kinds):
            yield
        self.stamp("forward_done")
        self._add({layer_timer.PREFIX + kind: ns for kind, ns in kinds.items()})

    def _add(self, values: dict[str, int]) -> None:
        for stamps in self._stamps:
            for stage, value in values.items():
                stamps.setdefault(stage, value)


class _Off(StepTrace):
    def stamp(self, stage: str) -> None:
        pass

    def forward(self, model: Any) -> AbstractContextManager[None]:
        return _NOTHING


#: The trace of a step without a traced request (and of every rank but 0): no stamps, no hooks.
OFF: StepTrace = _Off([])
