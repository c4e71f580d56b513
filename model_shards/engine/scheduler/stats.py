"""The scheduler's counters since start-up (:meth:`SchedulerState.stats` reports them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from model_shards.engine.speculative.verify import SpecCounters


@dataclass
class SchedulerCounters:
    """Totals since start-up (see :class:`SchedulerStats` for what each counts)."""

    prefill_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)
