"""The scheduler's counters, and the snapshot of them (with the pool's gauges) it reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from model_shards.config.scheduler import SchedulerStats

if TYPE_CHECKING:
    from model_shards.engine.scheduler.state import SchedulerState


@dataclass
class SchedulerCounters:
    """Totals since start-up (see :class:`SchedulerStats` for what each counts)."""

    prefill_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0


def scheduler_stats(state: SchedulerState) -> SchedulerStats:
    """The counters so far, and the pool and queues as they are now."""
    counters = state.counters
    return SchedulerStats(
        prefill_tokens_computed=counters.prefill_tokens,
        prefix_cache_hit_tokens=counters.hit_tokens,
        num_preemptions=counters.preemptions,
        num_free_blocks=state.blocks.num_free,
        num_cached_blocks=len(state.blocks.cache),
        num_blocks=state.config.num_blocks,
        num_running=len(state.running),
        num_waiting=len(state.waiting),
    )
