"""Every collective a replica uses. Layers and models call these, never torch.distributed.

Each primitive is a no-op (or identity) when its group has one member, so a
``tp = pp = 1`` replica runs with no process group at all. Timeouts are those
of the groups (set in :func:`model_shards.parallel.state.init_parallel`), so a
dead peer turns into an exception, not a hang. Point-to-point messages and the
plan broadcast go over :mod:`model_shards.parallel.local_links` where the
replica's ranks have them (CPU ranks of one host), with the same timeout. Ranks sharing
one GPU (``ps.host_tensors``) pass their tensors through host memory over gloo.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from model_shards.parallel.state import ParallelState
from model_shards.parallel.transports import SameHostTransports, open_same_host


@dataclass(frozen=True)
class Comm:
    """How this rank talks to the others: its groups (:class:`ParallelState`) and the
    same-host transports that stand in for gloo where every rank has them."""

    ps: ParallelState
    host: SameHostTransports = field(default_factory=SameHostTransports)

    @staticmethod
    def open(ps: ParallelState) -> Comm:
        """Collective: every rank of the replica calls it after ``init_parallel``."""
        return Comm(ps, open_same_host(ps))

    def close(self) -> None:
        self.host.close()


def _host(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``x`` as the tensor group takes it: a host copy where ranks share a GPU, else ``x``."""
    return x.cpu() if comm.ps.host_tensors else x


def tp_all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum ``x`` over the TP group, in place; returns ``x``. Row-parallel outputs use this.

    CPU ranks of one host sum through shared memory (bitwise the same result on
    every rank, see :mod:`model_shards.parallel.shm_all_reduce`); a tensor that
    does not fit its slots, and every other setup, goes over the TP group.
    """
    shm = comm.host.tp_shm
    if comm.ps.tp_size > 1 and not (shm is not None and shm.all_reduce(x)):
        staged = _host(x, comm)
        dist.all_reduce(staged, group=comm.ps.tp_group)
        if staged is not x:
            x.copy_(staged)
    return x


def tp_broadcast(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """TP rank 0's ``x`` into every TP rank's ``x`` (same shape and dtype), in place."""
    ps = comm.ps
    if ps.tp_size > 1:
        staged = _host(x, comm)
        dist.broadcast(staged, src=ps.pp_rank * ps.tp_size, group=ps.tp_group)
        if staged is not x:
            x.copy_(staged)
    return x


def tp_all_gather_last_dim(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Concatenate each TP rank's ``[..., n]`` into ``[..., tp * n]`` in TP-rank order."""
    if comm.ps.tp_size == 1:
        return x
    staged = _host(x, comm).contiguous()
    parts = [torch.empty_like(staged) for _ in range(comm.ps.tp_size)]
    dist.all_gather(parts, staged, group=comm.ps.tp_group)
    return torch.cat(parts, dim=-1).to(x.device)


def ep_all_to_all(
    x: torch.Tensor, send_counts: list[int], comm: Comm, recv_counts: list[int] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Expert parallelism's exchange over the TP group (the EP group): the rows of
    ``x [N, ...]``, grouped by destination, ``send_counts[r]`` of them to rank ``r`` → the
    rows sent here, grouped by source rank, and how many came from each. The counts travel
    first (one all-to-all of ints) unless ``recv_counts`` says them; any rank may send or
    receive no rows at all. At group size 1: ``x`` itself."""
    ps = comm.ps
    if ps.tp_size == 1:
        return x, [int(x.shape[0])]
    staged = _host(x, comm).contiguous()
    if recv_counts is None:
        counts = torch.tensor(send_counts, dtype=torch.int64, device=staged.device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=ps.tp_group)
        recv_counts = [int(n) for n in received.tolist()]
    out = staged.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, staged, recv_counts, send_counts, group=ps.tp_group)
    return out.to(x.device), recv_counts


@dataclass
class Pending:
    """Non-blocking sends in progress, oldest first; each buffer stays referenced until its
    work is known to be complete.

    gloo reports a point-to-point send complete only once it has been waited on (its
    ``is_completed()`` stays ``False``), so polling alone would keep every send and its
    buffer forever. Past ``max_pending`` entries the oldest is waited on. Its receiver
    takes messages in order and never waits on this rank's later sends, so the wait
    cannot deadlock; and a send that old has in practice long been taken.
    """

    max_pending: int = 32
    works: deque[tuple[dist.Work, torch.Tensor]] = field(default_factory=deque)

    def add(self, work: dist.Work | None, buffer: torch.Tensor) -> None:
        if work is not None:
            self.works.append((work, buffer))
        self.prune()

    def prune(self) -> None:
        """Forget completed work from the front (raising if one failed); bound the rest."""
        while self.works and (
            len(self.works) > self.max_pending or self.works[0][0].is_completed()
        ):
            self.works.popleft()[0].wait()

    def wait_all(self) -> None:
        while self.works:
            self.works.popleft()[0].wait()


def send_to_next_stage(x: torch.Tensor, comm: Comm, pending: Pending) -> None:
    """Hand this stage's activations to the same TP slot of the next stage (non-blocking).

    Non-blocking so a stage never waits for its neighbour while that neighbour
    waits on someone else (pipeline micro-batches in flight would deadlock). GPU
    activations go over the NCCL world group; CPU ones over the links, else gloo.
    """
    if comm.host.links is not None:
        comm.host.links.send(comm.ps.next_stage_rank, x)
        return
    buf = _host(x, comm).contiguous()
    pending.add(dist.isend(buf, dst=comm.ps.next_stage_rank, group=comm.ps.tensor_group), buf)


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, comm: Comm) -> torch.Tensor:
    """Receive activations of a known shape from the previous stage."""
    out = torch.empty(shape, dtype=dtype, device=comm.ps.device)
    if comm.host.links is not None:
        return comm.host.links.recv_into(comm.ps.prev_stage_rank, out)
    staged = _host(out, comm)
    dist.recv(staged, src=comm.ps.prev_stage_rank, group=comm.ps.tensor_group)
    return staged.to(out.device)


def broadcast_bytes_from_root(data: bytes, comm: Comm, pending: Pending) -> None:
    """Rank 0's side of :func:`broadcast_bytes`, without waiting for the receivers."""
    if comm.ps.world_size == 1:
        return
    if comm.host.links is not None:  # link sends never block: the plain broadcast is already this
        broadcast_bytes(data, comm)
        return
    length = torch.tensor([len(data)], dtype=torch.int64)
    pending.add(dist.broadcast(length, src=0, group=comm.ps.cpu_group, async_op=True), length)
    if data:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        pending.add(dist.broadcast(payload, src=0, group=comm.ps.cpu_group, async_op=True), payload)


def broadcast_bytes(data: bytes | None, comm: Comm, src: int = 0) -> bytes:
    """Broadcast a byte string from global rank ``src`` over the CPU group.

    ``src`` passes the bytes; every other rank passes ``None`` and gets them back.
    Two collectives: the length (int64), then the payload (uint8).
    """
    if comm.ps.world_size == 1:
        assert data is not None, "broadcast_bytes: the only rank must pass the data"
        return data
    if comm.host.links is not None:
        if comm.ps.rank != src:
            return comm.host.links.recv_bytes(src)
        assert data is not None
        for rank in range(comm.ps.world_size):
            if rank != src:
                comm.host.links.send(rank, data)
        return data
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(length, src=src, group=comm.ps.cpu_group)
    if comm.ps.rank == src:
        assert data is not None
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    if payload.numel():
        dist.broadcast(payload, src=src, group=comm.ps.cpu_group)
    return payload.numpy().tobytes()


def send_cpu(x: torch.Tensor, dst: int, comm: Comm, pending: Pending) -> None:
    """Send a small CPU tensor (sampled tokens, logits) over the CPU group, non-blocking."""
    if comm.host.links is not None:
        comm.host.links.send(dst, x.cpu())
        return
    buf = x.cpu().contiguous()
    pending.add(dist.isend(buf, dst=dst, group=comm.ps.cpu_group), buf)


def recv_cpu(shape: tuple[int, ...], dtype: torch.dtype, src: int, comm: Comm) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    if comm.host.links is not None:
        return comm.host.links.recv_into(src, out)
    dist.recv(out, src=src, group=comm.ps.cpu_group)
    return out


def all_reduce_min_int(value: int, comm: Comm) -> int:
    """The minimum of an integer over every rank of the replica (CPU group)."""
    if comm.ps.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=comm.ps.cpu_group)
    return int(t.item())
