"""Who this rank is inside a replica, and the process groups it talks over.

Global rank versus in-group ranks, for ``tp = 2, pp = 2`` (4 ranks)::

    global rank   pp_rank   tp_rank   TP group   PP group
         0           0         0       {0, 1}     {0, 2}
         1           0         1       {0, 1}     {1, 3}
         2           1         0       {2, 3}     {0, 2}
         3           1         1       {2, 3}     {1, 3}

``global rank = pp_rank * tp + tp_rank``. Never use the global rank where the
TP rank is meant. Tensors (activations) travel over the default group, whose
backend is ``nccl`` when each rank has its own CUDA device and ``gloo``
otherwise; metadata (step plans, sampled tokens) always travels over a gloo
CPU group. Every group carries the same timeout, so every collective has one.
When every TP rank is a CPU process of the same host, TP all-reduces go through
a shared-memory segment made here (:mod:`model_shards.parallel.shm_all_reduce`,
same timeout) instead of gloo; and when every rank of the replica is, plans,
activations and sampled tokens go rank to rank over Unix sockets
(:mod:`model_shards.parallel.local_links`, same timeout).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from model_shards.parallel.local_links import LocalLinks
from model_shards.parallel.shm_all_reduce import ShmAllReduce


@dataclass(frozen=True)
class ParallelState:
    """A frozen record of this rank's place in the replica, made once by :func:`init_parallel`."""

    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    device: torch.device
    backend: str
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    timeout_s: float
    # CPU TP ranks of one host sum through shared memory (None: gloo; see shm_all_reduce.py).
    tp_shm: ShmAllReduce | None = field(default=None, compare=False, repr=False)
    # CPU ranks of one host pass plans, activations and results over Unix sockets
    # (None: gloo; see local_links.py).
    links: LocalLinks | None = field(default=None, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int:
        """The global rank holding the same TP slot in the previous stage."""
        return (self.pp_rank - 1) * self.tp_size + self.tp_rank

    @property
    def next_stage_rank(self) -> int:
        return (self.pp_rank + 1) * self.tp_size + self.tp_rank

    @property
    def last_stage_leader(self) -> int:
        """The global rank that samples and reports tokens (tp_rank 0 of the last stage)."""
        return (self.pp_size - 1) * self.tp_size


def single_process_state(device: torch.device | None = None) -> ParallelState:
    """A world of one, with no process groups: every collective is a no-op."""
    return ParallelState(
        rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
        device=device or torch.device("cpu"), backend="none",
        tp_group=None, pp_group=None, cpu_group=None, timeout_s=0.0,
    )  # fmt: skip


def choose_backend(world_size: int, device: str) -> tuple[str, torch.device | None]:
    """``nccl`` when every rank can have its own CUDA device, else ``gloo`` on CPU."""
    if device == "cpu":
        return "gloo", None
    has_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    if device == "cuda" and not has_cuda:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(
            f"--device cuda needs one GPU per rank: tp*pp = {world_size} but {count} "
            f"CUDA device(s) are visible; lower -tp/-pp or use --device cpu"
        )
    return ("nccl", torch.device("cuda")) if has_cuda else ("gloo", None)


def init_parallel(
    rank: int, tp: int, pp: int, *, master_addr: str | None, master_port: int | None,
    device: str, timeout_s: float, local_world_size: int | None = None,
) -> ParallelState:  # fmt: skip
    """Join the replica's world and build its TP, PP and CPU groups (every rank calls this).

    ``master_addr``/``master_port`` ``None``: join with ``init_method="env://"``
    (``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets them). ``local_world_size``:
    ranks on this node (default: all of them), each needing its own GPU for
    NCCL; the CUDA device is ``LOCAL_RANK`` when set, else ``rank``.
    """
    world = tp * pp
    backend, cuda = choose_backend(local_world_size or world, device)
    timeout = timedelta(seconds=timeout_s)
    local_device = torch.device("cpu")
    if cuda is not None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        local_device = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend=backend,
        init_method="env://" if master_addr is None else f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world,
        timeout=timeout,
        device_id=local_device if cuda is not None else None,
    )
    tp_rank, pp_rank = rank % tp, rank // tp
    # Every rank must create every group, in the same order.
    tp_group = pp_group = None
    tp_ranks: list[int] = []
    for stage in range(pp):
        ranks = [stage * tp + t for t in range(tp)]
        group = dist.new_group(ranks, timeout=timeout) if tp > 1 else None
        if stage == pp_rank:
            tp_group, tp_ranks = group, ranks
    for slot in range(tp):
        ranks = [s * tp + slot for s in range(pp)]
        group = dist.new_group(ranks, timeout=timeout) if pp > 1 else None
        if slot == tp_rank:
            pp_group = group
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    tp_shm = None
    if tp_group is not None and backend == "gloo":
        tp_shm = ShmAllReduce.create(tp_group, tp_ranks, tp_rank, timeout_s)
    links = None
    if world > 1 and backend == "gloo":
        links = LocalLinks.create(rank, world, dist.group.WORLD, timeout_s)
    return ParallelState(
        rank=rank, tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp,
        device=local_device, backend=backend, tp_group=tp_group, pp_group=pp_group,
        cpu_group=cpu_group if cpu_group is not None else dist.group.WORLD,
        timeout_s=timeout_s, tp_shm=tp_shm, links=links,
    )  # fmt: skip


def destroy_parallel(ps: ParallelState | None = None) -> None:
    """Leave the world. With ``ps``, first wait (barrier) until every rank is leaving, so no
    rank tears its connections down under a peer still finishing its last operation."""
    if not dist.is_initialized():
        return
    if ps is not None and ps.world_size > 1:
        with contextlib.suppress(RuntimeError):  # a peer already gone: nothing to protect
            dist.barrier(group=ps.cpu_group)
    if ps is not None and ps.links is not None:
        ps.links.close()
    if ps is not None and ps.tp_shm is not None:
        ps.tp_shm.close()  # the segment was unlinked at start-up: this only unmaps it
    dist.destroy_process_group()
