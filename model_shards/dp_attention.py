"""Data-parallel attention with expert-parallel MoE (the DeepSeek layout), engine side.

``D`` replicas, each at tp = 1, run their own requests through attention (their own KV
cache, scheduler and coordinator), and share the experts of their MoE layers: rank ``r``
of the EP group holds experts ``r E/D .. (r+1) E/D - 1``, and every sparse layer of every
step sends each token to the rank of each of its experts and back (all-to-all:
:func:`~model_shards.layers.moe.dispatch_to_experts`, ``ShardContext.ep_comm``).

So every replica must join every exchange, in the same order: a step is taken by all of
them or by none. :meth:`LockstepEngine.step` runs this replica's coordinator step when it
has work and, when that ran no forward (nothing to do here now, or a step that scheduled
nothing), joins each sparse layer's exchange with zero tokens
(:meth:`~model_shards.layers.moe.SparseMoeBlock.idle`), layer by layer; the replicas
agree before each step whether any of them has work (:meth:`LockstepEngine.any_work`,
one all-reduce over the EP group's CPU group). Pipeline parallelism is not supported here.

Not wired into a replica layout yet: ``-dp D --enable-expert-parallel --dp-attention``
(one world of ``D`` ranks from ``launch``, each rank's coordinator serving its own
frontend address, its loop stepping through this class) is still to come.
"""

from __future__ import annotations

from model_shards.coordinator import Coordinator
from model_shards.layers.moe import SparseMoeBlock
from model_shards.parallel.comm import Comm, all_reduce_min_int
from model_shards.scheduler.scheduler import SeqUpdate


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

    def any_work(self) -> bool:
        """Whether any replica of the group has work (collective)."""
        return all_reduce_min_int(-int(self.coordinator.has_work()), self.ep_comm) < 0

    def step(self) -> list[SeqUpdate]:
        """One lockstep step: this replica's coordinator step, or an idle one that still
        joins every sparse layer's exchange. Call it on every replica while
        :meth:`any_work`."""
        joined = self.blocks[0].dispatches if self.blocks else 0
        updates = self.coordinator.step() if self.coordinator.has_work() else []
        if self.blocks and self.blocks[0].dispatches == joined:  # no forward ran here
            for block in self.blocks:
                block.idle(self.hidden_size, self.dtype, self.device)
        return updates
