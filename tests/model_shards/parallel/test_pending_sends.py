"""comm.Pending: non-blocking sends are retired, and their buffers released, as a
long-running rank goes on (gloo never reports a send complete until it is waited on)."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from model_shards.parallel import comm
from model_shards.parallel.comm import Comm
from tests.world import run_world


class _Work:
    def __init__(self, log: list[int], index: int, completes: bool) -> None:
        self.log, self.index, self.completes = log, index, completes

    def is_completed(self) -> bool:
        return self.completes

    def wait(self) -> bool:
        self.log.append(self.index)
        return True


def test_bounded_and_retired_oldest_first() -> None:
    waited: list[int] = []
    pending = comm.Pending(max_pending=4)
    for i in range(10):  # sends that never report completion (gloo's isend)
        pending.add(cast(Any, _Work(waited, i, completes=False)), torch.zeros(1))
        assert len(pending.works) <= 4
    assert waited == [0, 1, 2, 3, 4, 5]
    pending.add(cast(Any, _Work(waited, 10, completes=True)), torch.zeros(1))
    assert len(pending.works) == 4  # a completed one behind older sends waits its turn
    pending.wait_all()
    assert waited == list(range(11)) and not pending.works


def _sender_and_receiver(peers: Comm, n: int) -> None:
    ps = peers.ps
    if ps.rank == 0:
        pending = comm.Pending(max_pending=8)
        for i in range(n):
            sent = torch.full((256,), float(i))
            pending.add(dist.isend(sent, dst=1), sent)
            assert len(pending.works) <= 8
        pending.wait_all()
    else:
        for i in range(n):
            got = torch.empty(256)
            dist.recv(got, src=0)
            assert torch.equal(got, torch.full((256,), float(i)))


@pytest.mark.timeout(60)
def test_gloo_isends_stay_bounded_and_arrive_in_order() -> None:
    run_world(_sender_and_receiver, 1, 2, 200, timeout=50)
