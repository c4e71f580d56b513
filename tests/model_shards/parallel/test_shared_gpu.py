"""Ranks sharing one GPU (``SHARDSERVE_SHARED_GPU=1``): the choice, the collectives through
host memory, and a tp=2 replica whose greedy tokens are tp=1's.

On CPU the staging copies are no-ops but every staged branch runs (``host_tensors`` forced
on); ``make gpu-check`` runs this file with ``SHARDSERVE_TEST_DEVICE=cuda`` and the variable
set, where both ranks sit on ``cuda:0`` and the tensors really cross through the host.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel import comm as collectives
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import choose_backend, shared_gpu, single_process_state
from tests.checkpoints import build_tiny_llama
from tests.model_shards.engine.engine_harness import build_worker, run_to_completion
from tests.world import TEST_DEVICE, run_world

PROMPTS = [[3, 17, 250, 96, 42, 7], [5, 6]]
NEW_TOKENS = 8
BLOCKS = 32  # of 4 tokens: a fixed pool, so three workers can share one GPU


def test_shared_gpu_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert shared_gpu("cuda", 1, "1") and shared_gpu("auto", 1, "1")
    assert not shared_gpu("cpu", 1, "1") and not shared_gpu("cuda", 8, None)
    assert not shared_gpu("cuda", 8, "0")
    with pytest.raises(ValueError, match="SHARDSERVE_SHARED_GPU='yes': use 1"):
        shared_gpu("cuda", 1, "yes")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        shared_gpu("cuda", 0, "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("SHARDSERVE_SHARED_GPU", "1")
    assert choose_backend(2, "cuda") == "gloo"  # NCCL would need two GPUs


def _staged_rank(peers: Comm) -> None:
    """Every tensor collective with ``host_tensors`` on, over gloo (no shared memory)."""
    comm = Comm(dataclasses.replace(peers.ps, host_tensors=True))
    r, device = comm.ps.tp_rank, comm.ps.device
    x = torch.full((2, 3), float(r + 1), device=device)
    assert collectives.tp_all_reduce(x, comm) is x
    assert torch.equal(x, torch.full((2, 3), 3.0, device=device))
    gathered = collectives.tp_all_gather_last_dim(torch.full((2, 1), float(r), device=device), comm)
    assert gathered.device == device and gathered.tolist() == [[0.0, 1.0], [0.0, 1.0]]
    rows = torch.arange(3, dtype=torch.float32, device=device) + 10 * r  # 10r, 10r+1, 10r+2
    out, counts = collectives.ep_all_to_all(rows[:, None], [1, 2] if r == 0 else [2, 1], comm)
    expected = [[0.0], [10.0], [11.0]] if r == 0 else [[1.0], [2.0], [12.0]]
    assert out.device == device and out.tolist() == expected, out
    assert counts == ([1, 2] if r == 0 else [2, 1])


@pytest.mark.timeout(90)
def test_collectives_through_host_memory() -> None:
    run_world(_staged_rank, 2, 1, timeout=75)


def _requests() -> list[GenerateRequest]:
    greedy = SamplingParams(0.0)
    return [
        GenerateRequest(str(i), p, NEW_TOKENS, greedy, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]


def _tp2_rank(peers: Comm, model_dir: str, out: str) -> None:
    from model_shards.engine.coordinator import Coordinator

    comm = Comm(dataclasses.replace(peers.ps, host_tensors=True))
    worker = build_worker(comm, model_dir, BLOCKS)
    if comm.ps.rank != 0:
        worker.serve_forever()
        return
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=64)
    Path(out).write_text(json.dumps(run_to_completion(coord, _requests())))
    coord.shutdown()


@pytest.mark.timeout(180)
def test_tp2_sharing_a_device_gives_tp1_tokens(tmp_path: Path) -> None:
    from model_shards.engine.coordinator import Coordinator

    model_dir = build_tiny_llama(tmp_path / "llama", sharded=False)
    device = torch.device("cuda", 0) if TEST_DEVICE == "cuda" else None
    worker = build_worker(Comm(single_process_state(device)), str(model_dir), BLOCKS)
    coord = Coordinator(worker, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=64)
    alone = run_to_completion(coord, _requests())
    del coord, worker
    run_world(_tp2_rank, 2, 1, str(model_dir), str(tmp_path / "tp2.json"), timeout=150)
    assert json.loads((tmp_path / "tp2.json").read_text()) == alone
    assert all(len(tokens) == NEW_TOKENS for tokens in alone.values())
