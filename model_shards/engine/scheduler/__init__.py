"""Rank 0's scheduler: continuous batching, chunked prefill, paged KV with prefix caching.

* ``scheduler.py``: ``Scheduler``, the entry point: ``add``, ``abort``, ``schedule``, ``update``;
* ``sequence.py``: one request's state, its block hashes; ``ScheduledStep``, ``SeqUpdate``;
* ``state.py``: the pool, queues and counters all parts share; windowed tables kept to the window;
* ``decode.py``: one more token per running sequence (and its speculative drafts, if the free
  blocks hold them; a draft model's, asked for all of a step's sequences at once:
  ``offer_drafts``); preemption by recompute;
* ``prefill.py``: a step's token and seat limits (the pipeline cap); a prompt's next chunk;
* ``admission.py``: start the first waiting sequence after its prefix-cache hit, if it fits;
* ``step_builder.py``: the step being assembled and what is left of its limits;
* ``ahead.py``: async scheduling: a sequence's next chunk while its current one is in flight
  (a decode's token a *future token*, read on the ranks);
* ``block_manager.py``: the pool's block ids: free, held (refcounts) or parked in the cache;
* ``prefix_cache.py``: chained content hashes of full blocks; the LRU of parked blocks;
* ``group_hits.py``: a hit over several KV groups: group-tagged hashes, windowed tables;
* ``lora_slots.py``: which LoRA adapter each slot holds and who uses it; idle slots reused LRU;
* ``stats.py``: the counters since start-up.

``SchedulerConfig`` and ``SchedulerStats`` live in :mod:`model_shards.config.scheduler`
(re-exported here). Pure Python, no torch: rank 0 keeps the bookkeeping, the ranks the memory,
and the plan carries every block id. Prefix caching covers sliding-window models too: each KV
group caches its own blocks, and a windowed group serves a hit with those still in its window.
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
