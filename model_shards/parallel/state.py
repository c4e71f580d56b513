"""Who this rank is inside a replica, and the process groups it talks over.

Global rank versus in-group ranks, for ``tp = 2, pp = 2`` (4 ranks)::

    global rank   pp_rank   tp_rank   TP group   PP group
         0           0         0       {0, 1}     {0, 2}
         1           0         1       {0, 1}     {1, 3}
         2           1         0       {2, 3}     {0, 2}
         3           1         1       {2, 3}     {1, 3}

``global rank = pp_rank * tp + tp_rank``. Never use the global rank where the
TP rank is meant. Tensors (activations, TP all-reduces) travel over the default
group, whose backend is ``nccl`` when each rank has its own CUDA device and
``gloo`` otherwise; metadata (step plans, sampled tokens) always travels over a
gloo CPU group. Pipeline stages talk point to point over the default group, so
no per-slot pipeline groups are made. Every group carries the same timeout, so
every collective has one. This record holds ranks and groups only; the same-host
transports of CPU replicas live in :mod:`model_shards.parallel.transports`.

``SHARDSERVE_SHARED_GPU=1`` (a check, not a way to serve fast): every rank of a CUDA
replica on ``cuda:0`` and its tensors over gloo through host memory (NCCL refuses two
ranks on one device), so the sharded CUDA path runs on one GPU; decode graphs are off
there (a host copy cannot be captured).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from model_shards.config.replica import ranks_use_gpus
from model_shards.parallel.store import bound_store


@dataclass(frozen=True)
class ParallelState:
    """A frozen record of this rank's place in the replica, made once by :func:`init_parallel`."""

    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    device: torch.device
    tp_group: dist.ProcessGroup | None  # None: tp == 1
    tensor_group: dist.ProcessGroup | None  # NCCL world for stage hand-offs; None: default
    cpu_group: dist.ProcessGroup | None  # gloo: plans, tokens, agreements
    timeout_s: float
    host_tensors: bool = False  # CUDA tensors cross ranks through host memory (gloo)

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
        rank=0,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        device=device or torch.device("cpu"),
        tp_group=None,
        tensor_group=None,
        cpu_group=None,
        timeout_s=0.0,
    )


SHARED_GPU_ENV = "SHARDSERVE_SHARED_GPU"


def shared_gpu(device: str, gpu_count: int, env: str | None) -> bool:
    """Whether every rank shares ``cuda:0`` with tensors over gloo (``env``: the value of
    :data:`SHARED_GPU_ENV`): ``1`` with a non-CPU ``--device`` and a GPU visible."""
    if env not in (None, "", "0", "1"):
        raise ValueError(f"{SHARED_GPU_ENV}={env!r}: use 1 (ranks share cuda:0) or 0")
    if env != "1" or device == "cpu":
        return False
    if gpu_count < 1:
        raise ValueError(f"{SHARED_GPU_ENV}=1 needs a CUDA device; none is visible")
    return True


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(world_size: int, device: str) -> str:
    """``nccl`` when every rank can have its own CUDA device, else ``gloo`` on CPU
    (:func:`~model_shards.config.replica.ranks_use_gpus`: too few GPUs is a ``ValueError``)
    or on one shared GPU (:func:`shared_gpu`)."""
    count = _gpu_count()
    if shared_gpu(device, count, os.environ.get(SHARED_GPU_ENV)):
        return "gloo"
    on_gpus = ranks_use_gpus(device, world_size, count, f"{world_size} rank(s)")
    return "nccl" if on_gpus else "gloo"


def init_parallel(
    rank: int,
    tp: int,
    pp: int,
    *,
    master_addr: str,
    master_port: int,
    device: str,
    timeout_s: float,
    cuda_index: int | None = None,
    local_world_size: int | None = None,
    hosts_store: bool | None = None,
) -> ParallelState:
    """Join the replica's world and build its groups (every rank calls this).

    The world's store is at ``master_addr:master_port``: ``hosts_store`` (default: rank 0)
    runs its server, listening on ``master_addr`` only (:func:`~model_shards.parallel.store.
    bound_store`); under torchrun that is its own rank 0 (``MASTER_ADDR``). The world is first
    joined over gloo (the CPU group), and every rank, on every node, agrees there on
    one tensor backend before any NCCL group exists (:func:`agree_on_cuda`).
    ``cuda_index``: this rank's GPU among the visible ones, passed explicitly by the
    caller (an inherited ``LOCAL_RANK`` must not put every rank on one GPU);
    ``local_world_size``: ranks on this node (default: all), each needing its own GPU.
    """
    world = tp * pp
    backend = choose_backend(local_world_size or world, device)
    shared = shared_gpu(device, _gpu_count(), os.environ.get(SHARED_GPU_ENV))
    timeout = timedelta(seconds=timeout_s)
    server = rank == 0 if hosts_store is None else hosts_store
    store = bound_store(
        master_addr, master_port, is_server=server, timeout=timeout, world_size=world
    )
    dist.init_process_group(
        backend="gloo", store=store, rank=rank, world_size=world, timeout=timeout
    )
    use_cuda = agree_on_cuda(backend == "nccl" or shared, rank)
    local_device = torch.device("cpu")
    if use_cuda:
        index = 0 if shared else rank if cuda_index is None else cuda_index
        local_device = torch.device("cuda", index)
        torch.cuda.set_device(local_device)
    tp_rank, pp_rank = rank % tp, rank // tp
    tp_group = _tp_groups(tp, pp, backend, timeout)[pp_rank]
    tensor_group = None
    if backend == "nccl" and world > 1:
        tensor_group = dist.new_group(timeout=timeout, backend="nccl")
    return ParallelState(
        rank=rank,
        tp_rank=tp_rank,
        tp_size=tp,
        pp_rank=pp_rank,
        pp_size=pp,
        device=local_device,
        tp_group=tp_group,
        tensor_group=tensor_group,
        cpu_group=dist.group.WORLD,
        timeout_s=timeout_s,
        host_tensors=shared and world > 1,
    )


def _tp_groups(
    tp: int, pp: int, backend: str, timeout: timedelta
) -> list[dist.ProcessGroup | None]:
    """Every stage's TP group (``None`` at ``tp == 1``); every rank creates every group,
    in the same order, as torch.distributed requires."""
    if tp == 1:
        return [None] * pp
    return [
        dist.new_group([stage * tp + t for t in range(tp)], timeout=timeout, backend=backend)
        for stage in range(pp)
    ]


def agree_on_cuda(local_cuda: bool, rank: int) -> bool:
    """Whether every rank of the world has its GPU (one gloo all-reduce); a replica whose
    ranks disagree is refused on every rank, never split between NCCL and gloo."""
    flags = torch.tensor([int(local_cuda), -int(local_cuda)], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # [min over ranks, -max over ranks]
    every, some = bool(flags[0]), bool(-flags[1])
    if some and not every:
        raise RuntimeError(
            f"rank {rank}: some ranks of this replica have a CUDA device for themselves and "
            f"some do not (this rank: {'yes' if local_cuda else 'no'}); give every node "
            f"enough GPUs or use --device cpu"
        )
    return every


def destroy_parallel(
    ps: ParallelState | None = None, close: Callable[[], None] | None = None
) -> None:
    """Leave the world. With ``ps``, first wait (barrier) until every rank is leaving, so no
    rank tears its connections down under a peer still finishing its last operation;
    ``close`` (the same-host transports' ``close``) runs after the barrier, before the
    process groups go."""
    if not dist.is_initialized():
        return
    if ps is not None and ps.world_size > 1:
        with contextlib.suppress(RuntimeError):  # a peer already gone: nothing to protect
            dist.barrier(group=ps.cpu_group)
    if close is not None:
        close()
    dist.destroy_process_group()
