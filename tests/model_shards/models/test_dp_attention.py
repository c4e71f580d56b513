"""Data-parallel attention + expert-parallel MoE at dp=2, tp=1 (engine level): two replicas,
each with its own scheduler and KV cache, holding half the experts each and exchanging
tokens in every sparse layer (all-to-all, ``model_shards/engine/dp_attention.py``). 16 requests of
different prompt and output lengths, replica 1 idle for the first steps (it still joins
every exchange); every output equals the single-replica run's."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from model_shards.config.model import ModelConfig
from model_shards.config.replica import ReplicaConfig
from model_shards.engine.coordinator import Coordinator
from model_shards.engine.dp_attention import LockstepEngine
from model_shards.layers.moe import SparseMoeBlock
from model_shards.messages import GenerateRequest, SamplingParams
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state
from model_shards.worker.decoder_worker import Worker
from tests.families import mixtral, qwen2_moe
from tests.world import run_world

MAX_LEN = 128
IDLE_STEPS = 6  # replica 1 gets its requests only after this many lockstep steps
FAMILIES = [mixtral, qwen2_moe]


def _requests() -> list[GenerateRequest]:
    return [
        GenerateRequest(
            f"r{i}",
            [(7 * i + j) % 400 + 3 for j in range(3 + (5 * i) % 17)],
            4 + (5 * i) % 9,
            SamplingParams(0.0),
            ignore_eos=True,
        )
        for i in range(16)
    ]


def _coordinator(worker: Worker) -> Coordinator:
    return Coordinator(worker, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_LEN)


def _dp_rank(peers: Comm, dirs: dict[str, str], out_dir: str) -> None:
    rank = peers.ps.tp_rank  # the EP group: both replicas
    mine = [r for i, r in enumerate(_requests()) if i % 2 == rank]
    for name, model_dir in dirs.items():
        cfg = ModelConfig.from_dir(model_dir)
        replica = ReplicaConfig(model_dir, dtype="float32", max_num_seqs=8, block_size=4)
        local = Comm(single_process_state())  # this replica: tp = 1
        worker = Worker.build(replica, cfg, local, MAX_LEN, ep_comm=peers)
        blocks = [m for m in worker.model.modules() if isinstance(m, SparseMoeBlock)]
        assert all(b.experts.num_local == b.moe.num_experts // 2 for b in blocks)
        engine = LockstepEngine(_coordinator(worker), peers)
        tokens: dict[str, list[int]] = {r.request_id: [] for r in mine}
        steps = 0
        if rank == 0:
            for req in mine:
                engine.coordinator.add_request(req)
        while steps < IDLE_STEPS or engine.any_work():
            if rank == 1 and steps == IDLE_STEPS:
                for req in mine:
                    engine.coordinator.add_request(req)
            for update in engine.step():
                tokens[update.output.request_id] += update.output.new_token_ids
            steps += 1
        assert blocks[0].dispatches == steps  # joined every exchange, idle or not
        Path(out_dir, f"{name}-{rank}.json").write_text(json.dumps(tokens))


def _single_replica(family: ModuleType, path: Path) -> dict[str, list[int]]:
    cfg = ModelConfig.from_dir(path)
    replica = ReplicaConfig(str(path), dtype="float32", max_num_seqs=8, block_size=4)
    coord = _coordinator(Worker.build(replica, cfg, Comm(single_process_state()), MAX_LEN))
    for req in _requests():
        coord.add_request(req)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in _requests()}
    while coord.has_work():
        for update in coord.step():
            tokens[update.output.request_id] += update.output.new_token_ids
    return tokens


@pytest.mark.timeout(300)
def test_dp_attention_outputs_equal_the_single_replica(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("dp-attention")
    paths = {f.NAME: f.build(root / f.NAME) for f in FAMILIES}
    out = root / "out"
    out.mkdir()
    run_world(_dp_rank, 2, 1, {n: str(p) for n, p in paths.items()}, str(out), timeout=240)
    for family in FAMILIES:
        expected = _single_replica(family, paths[family.NAME])
        got: dict[str, list[int]] = {}
        for rank in (0, 1):
            got |= json.loads((out / f"{family.NAME}-{rank}.json").read_text())
        assert got == expected, family.NAME
        lengths = {len(t) for t in got.values()}
        assert len(lengths) > 3, "requests of different lengths"
