"""Device and tensor-backend choice: a machine with GPUs never silently serves on its CPU,
and every rank of a world agrees on NCCL versus gloo before any NCCL group exists."""

from __future__ import annotations

import pytest
import torch

from model_shards.parallel.comm import Comm
from model_shards.parallel.state import agree_on_cuda, choose_backend
from tests.world import run_world


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_backend_follows_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    assert choose_backend(2, "auto") == "gloo"
    assert choose_backend(2, "cpu") == "gloo"
    with pytest.raises(ValueError, match="--device cuda needs one GPU per rank"):
        choose_backend(1, "cuda")
    _gpus(monkeypatch, 4)
    assert choose_backend(4, "auto") == choose_backend(2, "cuda") == "nccl"
    assert choose_backend(4, "cpu") == "gloo"


def test_too_few_gpus_with_device_auto_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"--device auto needs one GPU per rank.*--device cpu"):
        choose_backend(2, "auto")


def _disagreeing_rank(peers: Comm) -> None:
    rank = peers.ps.rank
    assert agree_on_cuda(False, rank) is False  # nobody has a GPU: gloo
    with pytest.raises(RuntimeError, match="some ranks of this replica have a CUDA device"):
        agree_on_cuda(rank == 1, rank)  # only rank 1 does: refused on both


@pytest.mark.timeout(60)
def test_ranks_that_disagree_on_cuda_are_all_refused() -> None:
    run_world(_disagreeing_rank, 1, 2, timeout=45)
