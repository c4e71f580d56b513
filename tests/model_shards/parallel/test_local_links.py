"""Rank-to-rank messages over Unix sockets (model_shards/parallel/local_links.py), in
spawned gloo worlds:

* every message arrives whole and in order, tensors of each dtype and bytes of any
  size, among them messages far bigger than a socket buffer, sent by two ranks to
  each other at the same time (a blocking send would deadlock there);
* the ``comm`` primitives (plan broadcast, stage hand-off, results) use the links;
* a peer whose process ends makes the waiting rank raise at once, naming it; a peer
  that sends nothing makes it raise after the timeout;
* ``SHARDSERVE_LOCAL_LINKS=0`` keeps gloo, and the same messages still arrive.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model_shards.parallel import comm
from model_shards.parallel.comm import Comm
from model_shards.parallel.local_links import ENV_VAR, LocalLinks, unsupported_reason
from tests.world import run_world

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"no local links here: {unsupported_reason()}"
)


def _wmem_max() -> int:
    try:
        return int(Path("/proc/sys/net/core/wmem_max").read_text())
    except (OSError, ValueError):
        return 4 * 2**20


# float32 values: more than the biggest send buffer the kernel grants (twice wmem_max),
# so these messages go partly through the writer thread
BIG = max(6 * 2**20, 2 * _wmem_max() + 2**20) // 4


def _payload(i: int, sender: int) -> torch.Tensor | bytes:
    g = torch.Generator().manual_seed(100 * i + sender)
    kind = i % 5
    if kind == 0:
        return torch.randn(BIG if i % 10 == 0 else 7, generator=g)
    if kind == 1:
        return torch.randn(3, 576, generator=g).to(torch.bfloat16)
    if kind == 2:
        return torch.randint(-(2**62), 2**62, (33,), generator=g)
    if kind == 3:
        return bytes(torch.randint(0, 256, (i * 37,), generator=g, dtype=torch.uint8).tolist())
    return b""


def _receive(links: LocalLinks, i: int, src: int) -> None:
    want = _payload(i, src)
    if isinstance(want, bytes):
        assert links.recv_bytes(src) == want, f"message {i} from rank {src}"
    else:
        got = links.recv_into(src, torch.empty_like(want))
        assert torch.equal(got, want), f"message {i} from rank {src}"


def _exchange_rank(net: Comm, n: int) -> None:
    ps = net.ps
    links = net.host.links
    assert links is not None, "local links not set up for CPU ranks of one host"
    peers = [r for r in range(ps.world_size) if r != ps.rank]
    for i in range(n):  # everyone sends everything first: only non-blocking sends survive
        for peer in peers:
            links.send(peer, _payload(i, ps.rank))
    for i in range(n):
        for peer in peers:
            _receive(links, i, peer)
    assert links.overflows > 0, "no message exercised the writer thread"
    # comm's primitives ride on the links
    sent = links.messages_sent
    plan = comm.broadcast_bytes(b"plan" if ps.rank == 0 else None, net)
    assert plan == b"plan"
    if ps.rank == 0:
        comm.send_cpu(torch.arange(5), 1, net, comm.Pending())
    elif ps.rank == 1:
        assert torch.equal(comm.recv_cpu((5,), torch.int64, 0, net), torch.arange(5))
    if ps.rank == 0:
        assert links.messages_sent == sent + ps.world_size  # the plan to each peer, then one
    dist.barrier()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_messages_arrive_whole_and_in_order(world: int) -> None:
    run_world(_exchange_rank, 1, world, 30, timeout=100)


def _stage_rank(peers: Comm) -> None:
    ps = peers.ps
    assert peers.host.links is not None
    x = torch.randn(17, 576)
    if ps.pp_rank == 0:
        comm.send_to_next_stage(x * 0 + ps.rank, peers, comm.Pending())
    else:
        got = comm.recv_from_prev_stage((17, 576), torch.float32, peers)
        assert torch.equal(got, torch.full((17, 576), float(ps.prev_stage_rank)))
    dist.barrier()


@pytest.mark.timeout(60)
def test_stage_hand_off_goes_to_the_same_tp_slot() -> None:
    run_world(_stage_rank, 2, 2, timeout=50)


def _record_failed_receive(links: LocalLinks, src: int, out_dir: str) -> None:
    """Wait for a message from ``src`` that never comes; write how long and what was raised."""
    start = time.monotonic()
    try:
        links.recv_bytes(src)
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    Path(out_dir, "result").write_text(f"{time.monotonic() - start:.3f}\n{error}")


def _dead_peer_rank(peers: Comm, out_dir: str) -> None:
    ps = peers.ps
    links = peers.host.links
    assert links is not None
    if ps.rank == 1:
        links.send(0, b"last words")
        links.close()
        os._exit(0)  # gone without a word more
    assert links.recv_bytes(1) == b"last words"
    _record_failed_receive(links, 1, out_dir)
    os._exit(0)


@pytest.mark.timeout(60)
def test_a_peer_that_exits_is_noticed_at_once(tmp_path: Path) -> None:
    run_world(_dead_peer_rank, 1, 2, str(tmp_path), timeout=50)
    elapsed, error = (tmp_path / "result").read_text().split("\n", 1)
    assert "rank 1" in error and "closed" in error
    assert float(elapsed) < 5.0  # the world's timeout is 60 s


def _silent_peer_rank(peers: Comm, out_dir: str) -> None:
    ps = peers.ps
    links = LocalLinks.create(ps.rank, ps.world_size, None, timeout_s=1.0)
    assert links is not None
    if ps.rank == 0:
        _record_failed_receive(links, 1, out_dir)
    dist.barrier()
    links.close()


@pytest.mark.timeout(60)
def test_a_silent_peer_times_out(tmp_path: Path) -> None:
    run_world(_silent_peer_rank, 1, 2, str(tmp_path), timeout=50)
    elapsed, error = (tmp_path / "result").read_text().split("\n", 1)
    assert "rank 1" in error and "within 1 s" in error
    assert 0.9 < float(elapsed) < 10.0


def _gloo_rank(peers: Comm) -> None:
    ps = peers.ps
    assert peers.host.links is None
    plan = comm.broadcast_bytes(b"over gloo" if ps.rank == 0 else None, peers)
    assert plan == b"over gloo"


@pytest.mark.timeout(60)
def test_off_switch_keeps_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "0")  # spawned ranks inherit it
    run_world(_gloo_rank, 1, 2, timeout=50)
