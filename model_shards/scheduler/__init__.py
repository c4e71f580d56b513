"""Rank 0's scheduling decisions, in pure Python (no torch).

``Scheduler`` (continuous batching, chunked prefill, paged KV with prefix
caching and recompute preemption) is the one the coordinator uses.

Files: ``config`` (SchedulerConfig, SchedulerStats), ``sequence`` (per-request
state, ScheduledStep, SeqUpdate), ``prefix_cache`` (block hashing, LRU of
parked blocks), ``block_manager`` (the pool's refcounts), ``scheduler`` (policy).
"""

from model_shards.scheduler.config import SchedulerConfig, SchedulerStats
from model_shards.scheduler.scheduler import Scheduler
from model_shards.scheduler.sequence import ScheduledStep, SeqStatus, Sequence, SeqUpdate

__all__ = [
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SeqStatus",
    "SeqUpdate",
    "Sequence",
]
