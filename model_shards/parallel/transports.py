"""Same-host transports for a replica whose ranks are CPU processes of one host.

:class:`~model_shards.parallel.shm_all_reduce.ShmAllReduce` (TP all-reduces through one
``/dev/shm`` segment) and :class:`~model_shards.parallel.local_links.LocalLinks` (step plans,
activations and sampled tokens over Unix sockets) replace gloo; each is on for every rank or
for none. :class:`~model_shards.parallel.comm.Comm` routes through them; GPU ranks use NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from model_shards.parallel.local_links import LocalLinks
from model_shards.parallel.shm_all_reduce import ShmAllReduce
from model_shards.parallel.state import ParallelState


@dataclass(frozen=True)
class SameHostTransports:
    tp_shm: ShmAllReduce | None = None  # None: TP all-reduces over the TP group
    links: LocalLinks | None = None  # None: point-to-point over gloo / NCCL

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        if self.tp_shm is not None:
            self.tp_shm.close()  # the segment was unlinked at start-up: this only unmaps it


def open_same_host(ps: ParallelState) -> SameHostTransports:
    """Collective over the replica (every rank calls it, after :func:`init_parallel`)."""
    if ps.device.type != "cpu" or ps.world_size == 1:
        return SameHostTransports()
    tp_shm = None
    if ps.tp_group is not None:
        tp_ranks = [ps.pp_rank * ps.tp_size + t for t in range(ps.tp_size)]
        tp_shm = ShmAllReduce.create(ps.tp_group, tp_ranks, ps.tp_rank, ps.timeout_s)
    links = LocalLinks.create(ps.rank, ps.world_size, dist.group.WORLD, ps.timeout_s)
    return SameHostTransports(tp_shm, links)
