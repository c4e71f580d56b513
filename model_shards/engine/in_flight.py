"""Rank 0's steps in flight: launched on the ranks, their tokens not applied yet.

Pipeline parallelism keeps one micro-batch per stage in flight (disjoint sequences). Async
scheduling keeps two at one stage: the step the device runs and the next, planned before the
first one's tokens are back (:mod:`model_shards.engine.scheduler.ahead`), so scheduling, plan
encoding and the sampled ids' copy to the host hide behind the device's work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from model_shards.engine.scheduler.scheduler import ScheduledStep, Sequence
from model_shards.messages import StepPlan
from model_shards.worker.decoder_worker import Worker
from model_shards.worker.step_result import PendingResult, StepResult

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step whose tokens rank 0 has not applied yet."""

    scheduled: ScheduledStep
    plan: StepPlan
    sampled: list[Sequence]  # the sequences of the sampled chunks, in order
    result: StepResult | PendingResult | None  # rank 0 is the sampler (pp == 1): get() it


def resolve_async(asked: bool | None, worker: Worker, speculative: bool) -> bool:
    """Whether rank 0 schedules ahead of the step in flight: ``asked`` (``--async-scheduling``;
    ``None``: where the backend queues device work, so the host's planning hides behind it),
    for a one-stage replica of a text model (no image inputs or position streams of its own)
    without speculative decoding; otherwise not (logged when asked)."""
    served = worker.ps.pp_size == 1 and worker.media is None and worker.positions is None
    served = served and not speculative
    if asked and not served:
        log.info("async scheduling off: pipeline stages, images or speculative decoding")
    return served and (worker.ops.queues_work if asked is None else asked)
