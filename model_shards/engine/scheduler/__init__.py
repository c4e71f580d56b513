"""Rank 0's scheduling decisions, in pure Python (no torch).

``Scheduler`` (continuous batching, chunked prefill, paged KV with prefix
caching and recompute preemption) is the one the coordinator uses.

Files: ``config`` (SchedulerConfig, SchedulerStats), ``sequence`` (per-request
state, ScheduledStep, SeqUpdate), ``prefix_cache`` (block hashing, LRU of
parked blocks), ``block_manager`` (the pool's refcounts), ``scheduler`` (the
policy and the entry point), ``state`` (queues, pool and counters every part
shares), ``step_builder`` (the step being assembled), ``decode`` (decodes and
preemption), ``prefill`` (step limits with the pipeline cap, prompt chunks),
``admission`` (starting waiting sequences), ``stats`` (the counters' snapshot).
"""

from model_shards.config.scheduler import SchedulerConfig, SchedulerStats
from model_shards.engine.scheduler.scheduler import Scheduler
from model_shards.engine.scheduler.sequence import ScheduledStep, SeqStatus, Sequence, SeqUpdate

__all__ = [
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "SeqStatus",
    "SeqUpdate",
    "Sequence",
]
