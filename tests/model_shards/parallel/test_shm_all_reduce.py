"""The shared-memory TP all-reduce (model_shards/parallel/shm_all_reduce.py) in spawned worlds.

* tp=2 and tp=4: 200 consecutive all-reduces through ``tp_all_reduce`` of
  varying shapes, float32 and bfloat16, in and out of inference mode, equal
  bitwise to the rank-ordered sum recomputed here and identical on every rank;
  a tensor bigger than the slot goes over gloo, interleaved with shm calls;
* a peer that never arrives: the waiting rank raises within the timeout;
  a peer that exits: the waiting rank raises long before the timeout;
* ``SHARDSERVE_SHM_ALLREDUCE=0`` keeps gloo;
* no ``/dev/shm`` segment outlives start-up, and stale ones are swept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from model_shards.parallel.comm import Comm, tp_all_reduce
from model_shards.parallel.shm_all_reduce import (
    ENV_VAR,
    NAME_PREFIX,
    SHM_DIR,
    ShmAllReduce,
    sweep_stale_segments,
    unsupported_reason,
)
from model_shards.parallel.state import ParallelState
from model_shards.parallel.transports import SameHostTransports
from tests.world import run_world

CALLS = 200
ROWS = [1, 3, 32, 7, 64, 257, 2]
SMALL_SLOT = 4096  # [1, 576] float32 (2304 bytes) fits, [32, 576] does not

pytestmark = pytest.mark.skipif(
    unsupported_reason() is not None, reason=f"no shm all-reduce here: {unsupported_reason()}"
)


def _case(i: int) -> tuple[tuple[int, int], torch.dtype]:
    """Call ``i``'s shape and dtype; after ``CALLS``, alternately too big and small a slot."""
    if i >= CALLS:
        return ((1, 576) if i % 2 else (32, 576)), torch.float32
    return (ROWS[i % len(ROWS)], 576), (torch.float32, torch.bfloat16)[(i // 3) % 2]


def _input(i: int, tp_rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * i + tp_rank)
    return torch.randn(shape, generator=g).to(dtype)


def _expected(i: int, tp: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The contract: rank-ordered sum; half types accumulate in float32, rounded once."""
    parts = [_input(i, r, shape, dtype) for r in range(tp)]
    acc = parts[0].float()
    for p in parts[1:]:
        acc += p.float()
    return acc.to(dtype)


def _name_file(out_dir: str, ps: ParallelState, shm: ShmAllReduce) -> None:
    assert not os.path.exists(os.path.join(SHM_DIR, shm.name)), "segment not unlinked at start-up"
    Path(out_dir, f"name-{ps.rank}").write_text(shm.name)


def _sums_rank(peers: Comm, out_dir: str) -> None:
    ps = peers.ps
    shm = peers.host.tp_shm
    assert shm is not None, "shm all-reduce not enabled for a CPU tp world on one host"
    _name_file(out_dir, ps, shm)
    results = {}
    for i in range(CALLS):
        shape, dtype = _case(i)
        x = _input(i, ps.tp_rank, shape, dtype)
        if i % 2:
            with torch.inference_mode():
                assert tp_all_reduce(x, peers) is x
        else:
            assert tp_all_reduce(x, peers) is x
        results[f"c{i}"] = x
    assert shm.calls == CALLS, "some all-reduce did not go through shared memory"
    # Bigger than the slot: gloo, interleaved with calls that fit.
    small = ShmAllReduce.create(ps.tp_group, shm.ranks, ps.tp_rank, 60.0, slot_bytes=SMALL_SLOT)
    assert small is not None
    _name_file(out_dir + "/small", ps, small)
    tiny = Comm(ps, SameHostTransports(tp_shm=small))
    for i in range(CALLS, CALLS + 6):
        x = _input(i, ps.tp_rank, *_case(i))
        results[f"c{i}"] = tp_all_reduce(x, tiny)
    assert small.calls == 3
    small.close()
    save_file(results, os.path.join(out_dir, f"rank{ps.tp_rank}.safetensors"))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tp", [2, 4])
def test_sums_exact_and_identical_on_every_rank(tp: int, tmp_path: Path) -> None:
    (tmp_path / "small").mkdir()
    run_world(_sums_rank, tp, 1, str(tmp_path), timeout=150)
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(tp)]
    for i in range(CALLS + 6):
        shape, dtype = _case(i)
        want, got = _expected(i, tp, shape, dtype), [rank[f"c{i}"] for rank in ranks]
        assert all(torch.equal(g, got[0]) for g in got), f"call {i}: ranks differ"
        if i >= CALLS and i % 2 == 0 and tp > 2:  # gloo's ring sums in another order
            torch.testing.assert_close(got[0], want)
        else:
            assert got[0].dtype == dtype and torch.equal(got[0], want), f"call {i}"
    _assert_no_segments(tmp_path, tp)
    _assert_no_segments(tmp_path / "small", tp)


def _assert_no_segments(out_dir: Path, world: int) -> None:
    names = {Path(out_dir, f"name-{r}").read_text() for r in range(world)}
    assert len(names) == 1, f"ranks of one TP group mapped different segments: {names}"
    assert not os.path.exists(os.path.join(SHM_DIR, names.pop()))


def _late_peer_rank(peers: Comm, out_dir: str) -> None:
    ps = peers.ps
    shm = ShmAllReduce.create(ps.tp_group, [0, 1], ps.tp_rank, timeout_s=1.0)
    assert shm is not None
    if ps.tp_rank == 0:
        x = torch.ones(8)
        assert shm.all_reduce(x) and torch.equal(x, torch.full((8,), 2.0))
        error = again = "no error"
        start = time.monotonic()
        try:
            shm.all_reduce(x)  # rank 1 never makes this call
        except RuntimeError as e:
            error = str(e)
        elapsed = time.monotonic() - start
        try:
            shm.all_reduce(x)
        except RuntimeError as e:
            again = str(e)
        Path(out_dir, "result.json").write_text(json.dumps([elapsed, error, again]))
    else:
        x = torch.ones(8)
        shm.all_reduce(x)
    dist.barrier(group=ps.tp_group)  # rank 1 waits here, alive, while rank 0 times out
    shm.close()


@pytest.mark.timeout(120)
def test_peer_that_never_arrives_times_out(tmp_path: Path) -> None:
    run_world(_late_peer_rank, 2, 1, str(tmp_path), timeout=90)
    elapsed, error, again = json.loads((tmp_path / "result.json").read_text())
    assert 1.0 <= elapsed < 4.0, elapsed
    assert "TP rank 1 (global rank 1" in error and "did not arrive within 1 s" in error, error
    assert "unusable after an earlier failure" in again and "TP rank 1" in again


def _dead_peer_rank(peers: Comm, out_dir: str) -> None:
    ps = peers.ps
    shm = ShmAllReduce.create(ps.tp_group, [0, 1], ps.tp_rank, timeout_s=60.0)
    assert shm is not None
    Path(out_dir, f"name-{ps.rank}").write_text(shm.name)
    if ps.tp_rank == 1:
        os._exit(0)  # dies without a word
    start = time.monotonic()
    try:
        shm.all_reduce(torch.ones(8))
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    Path(out_dir, "result.json").write_text(json.dumps([time.monotonic() - start, error]))
    os._exit(0)  # the world is broken: skip the goodbye barrier


@pytest.mark.timeout(120)
def test_peer_that_exits_is_noticed_before_the_timeout(tmp_path: Path) -> None:
    run_world(_dead_peer_rank, 2, 1, str(tmp_path), timeout=90)
    elapsed, error = json.loads((tmp_path / "result.json").read_text())
    assert "TP rank 1" in error and "has exited" in error, error
    assert elapsed < 10, elapsed
    _assert_no_segments(tmp_path, 2)


def _gloo_rank(peers: Comm, out_dir: str) -> None:
    ps = peers.ps
    assert peers.host.tp_shm is None
    x = torch.full((4, 576), float(ps.tp_rank + 1))
    assert torch.equal(tp_all_reduce(x, peers), torch.full((4, 576), 3.0))


@pytest.mark.timeout(120)
def test_env_var_keeps_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "0")
    run_world(_gloo_rank, 2, 1, str(tmp_path), timeout=90)


def test_env_var_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "off")
    assert unsupported_reason() == f"{ENV_VAR}=off"
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=ENV_VAR):
        unsupported_reason()


def test_stale_segments_are_swept() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    stale = Path(SHM_DIR, f"{NAME_PREFIX}{int(done.stdout)}_deadbeef")
    live = Path(SHM_DIR, f"{NAME_PREFIX}{os.getpid()}_cafebabe")
    try:
        stale.write_bytes(b"x")
        live.write_bytes(b"x")
        sweep_stale_segments()
        assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
