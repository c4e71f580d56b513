"""The shm all-reduce under cpu_budget's spin budget: spin that long, then sleep (no 5 ms
of sched_yield), with the same sums when a peer arrives late (the sleeping path)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model_shards.launch.cpu_budget import SPIN_ENV
from model_shards.parallel.comm import Comm
from model_shards.parallel.shm_all_reduce import ShmAllReduce
from tests.world import run_world


def _late_sums_rank(peers: Comm, out_dir: str) -> None:
    ps = peers.ps
    shm = ShmAllReduce.create(ps.tp_group, [0, 1], ps.tp_rank, timeout_s=30.0)
    assert shm is not None
    sums = []
    for i in range(6):
        if ps.tp_rank == 1 and i % 2 == 1:
            time.sleep(0.02)  # rank 0 outlasts its spin and sleeps
        x = torch.full((64,), float(ps.tp_rank + 1 + i))
        assert shm.all_reduce(x)
        sums.append(x.tolist())
    report = {"polls": shm._spin_polls, "yield_s": shm._yield_s, "sums": sums}
    Path(out_dir, f"rank{ps.tp_rank}.json").write_text(json.dumps(report))
    dist.barrier(group=ps.tp_group)
    shm.close()


@pytest.mark.timeout(120)
def test_spin_budget_then_sleep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPIN_ENV, "20")  # what a rank whose cores are filled is started with
    run_world(_late_sums_rank, 2, 1, str(tmp_path), timeout=90)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["polls"] == 400 and rank["yield_s"] == 0.0  # 20 us at 50 ns a poll
        assert rank["sums"] == [[float(2 * i + 3)] * 64 for i in range(6)]
