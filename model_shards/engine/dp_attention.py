"""Data-parallel attention with expert-parallel MoE (the DeepSeek layout), engine side.

``D`` replicas at tp = 1 run their own requests through attention (own KV cache, scheduler and
coordinator) and share their MoE experts: EP rank ``r`` holds experts ``r E/D .. (r+1) E/D - 1``,
and every sparse layer of every step exchanges tokens all-to-all
(:func:`~model_shards.layers.moe.dispatch_to_experts`, ``ShardContext.ep_comm``).

So every replica joins every exchange, in the same order: a step is taken by all or by none.
Before each step the replicas agree whether any has work (:meth:`LockstepEngine.agree`, one
all-reduce); a replica whose step ran no forward joins each sparse layer with zero tokens
(:meth:`~model_shards.layers.moe.SparseMoeBlock.idle`). No pipeline parallelism.

Launched by :mod:`model_shards.launch.dp_attention` (``serve -dp D --enable-expert-parallel
--dp-attention``): each rank coordinates its own replica on its own ZMQ address.
"""

from __future__ import annotations

import logging

from model_shards.engine.coordinator import Coordinator
from model_shards.engine.engine_port import PortSettings
from model_shards.engine.scheduler.scheduler import SeqUpdate
from model_shards.engine.zmq_loop import FrontendSocket
from model_shards.layers.moe import SparseMoeBlock
from model_shards.parallel.comm import Comm, all_reduce_min_int

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.02  # how long an idle replica waits for its frontends between agreements


class LockstepEngine:
    """One replica's coordinator, stepping in lockstep with the other replicas of
    ``ep_comm`` (every one calls :meth:`any_work`, then :meth:`step`, alike)."""

    def __init__(self, coordinator: Coordinator, ep_comm: Comm) -> None:
        worker = coordinator.worker
        if worker.ps.pp_size != 1:
            raise ValueError("data-parallel attention runs each replica at -pp 1")
        self.coordinator, self.ep_comm = coordinator, ep_comm
        self.blocks = [m for m in worker.model.modules() if isinstance(m, SparseMoeBlock)]
        self.hidden_size = worker.model.config.hidden_size
        self.dtype, self.device = worker.dtype, worker.ps.device

    def _has_work(self) -> bool:
        """Local: a step to run, or frees (after an abort) to hand the worker."""
        c = self.coordinator
        return c.has_work() or c.scheduler.has_pending_frees()

    def any_work(self) -> bool:
        """Whether any replica of the group has work (collective)."""
        return self.agree(stop=False)[0]

    def agree(self, stop: bool) -> tuple[bool, bool]:
        """(any replica has work, any replica is stopping): one all-reduce (collective)."""
        mine = 2 * int(stop) + int(self._has_work())
        most = -all_reduce_min_int(-mine, self.ep_comm)  # the maximum over the group
        return most == 1, most >= 2

    def step(self) -> list[SeqUpdate]:
        """This replica's coordinator step, or an idle one that still joins every sparse
        layer's exchange. Call it on every replica while :meth:`any_work`."""
        joined = self.blocks[0].dispatches if self.blocks else 0
        updates = self.coordinator.step() if self._has_work() else []
        if self.blocks and self.blocks[0].dispatches == joined:  # no forward ran here
            for block in self.blocks:
                block.idle(self.hidden_size, self.dtype, self.device)
        return updates


def serve_lockstep(engine: LockstepEngine, address: str, settings: PortSettings) -> None:
    """This replica's ZMQ loop, in lockstep: each round reads the frontends, agrees with the
    group (work? stopping?), then every replica steps or none does. A ``Shutdown`` to any
    replica stops the group; the agreement's timeout makes a dead replica fail the others."""
    coord = engine.coordinator
    frontends = FrontendSocket(address, settings)
    log.info("data-parallel attention replica serving on %s", address)
    try:
        stopping, work = False, False
        while True:
            if not stopping:
                timeout_ms = 0 if work else int(IDLE_POLL_S * 1000)
                stopping = not frontends.answer_waiting(coord, timeout_ms)
            work, group_stopping = engine.agree(stopping)
            if group_stopping:
                break
            if work:
                frontends.send(coord.replies(engine.step()))
        coord.shutdown()
    except Exception as exc:
        log.exception("engine failed")
        frontends.fail(exc)
        raise
    finally:
        frontends.close()
