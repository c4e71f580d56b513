"""Pure checks of the deployment layouts: torchrun commands, rank derivation, DP planning."""

from __future__ import annotations

import json
import re

import pytest

from model_shards.config.replica import ReplicaConfig
from model_shards.launch.rank_process import TorchrunRank
from model_shards.launch.replicas import plan_data_parallel
from model_shards.launch.torchrun import NodeLayout, torchrun_command

CONFIG = ReplicaConfig(model_dir="/models/m", tp=2, pp=2, device="cpu")


def test_torchrun_command_for_two_nodes() -> None:
    layout = NodeLayout(2, 1, "node0:29500", "r1", local_addr="10.0.0.2")
    cmd = torchrun_command(CONFIG, "tcp://0.0.0.0:5555", layout, python="py")
    assert cmd[:3] == ["py", "-m", "model_shards.launch.torchrun_agent"]
    joined = " ".join(cmd)
    assert "--nnodes 2 --nproc-per-node 2" in joined
    assert "--rdzv-backend shardserve --rdzv-endpoint node0:29500 --rdzv-id r1" in joined
    assert "--rdzv-conf is_host=0 --local-addr 10.0.0.2" in joined  # node 0 hosts it
    assert cmd[cmd.index("--address") + 1] == "tcp://0.0.0.0:5555"
    assert cmd[-2:] == ["--node-rank", "1"]
    assert ReplicaConfig(**json.loads(cmd[cmd.index("--config-json") + 1])) == CONFIG


def test_one_node_hosts_its_own_rendezvous_on_loopback() -> None:
    cmd = torchrun_command(CONFIG, "tcp://0.0.0.0:5555", NodeLayout())
    assert cmd[cmd.index("--nproc-per-node") + 1] == "4"
    assert "--rdzv-endpoint 127.0.0.1:0 --rdzv-id shardserve --rdzv-conf is_host=1" in " ".join(cmd)
    assert cmd[cmd.index("--local-addr") + 1] == "127.0.0.1"  # MASTER_ADDR: the world's store


@pytest.mark.parametrize(
    ("layout", "needle"),
    [
        (NodeLayout(nnodes=3, rdzv_endpoint="h:1"), "--nnodes 3 does not divide tp*pp = 4"),
        (NodeLayout(nnodes=2), "--rdzv-endpoint"),
        (NodeLayout(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "--node-rank must be in 0..1"),
        (NodeLayout(nnodes=0), "--nnodes must be >= 1"),
    ],
)
def test_bad_node_layouts_name_the_flag(layout: NodeLayout, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        layout.nproc_per_node(4)


def _env(rank: int, world: int = 4, local: int = 2) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local),
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }


def test_replica_rank_follows_node_rank_not_rendezvous_order() -> None:
    # c10d put node 1 first: its workers got torchrun ranks 0 and 1
    assert TorchrunRank.from_env(_env(0), node_rank=1, world_size=4).rank == 2
    assert TorchrunRank.from_env(_env(1), node_rank=1, world_size=4).rank == 3
    assert TorchrunRank.from_env(_env(3), node_rank=0, world_size=4).rank == 1


def test_torchrun_env_is_checked() -> None:
    with pytest.raises(ValueError, match="not started by torchrun: RANK"):
        TorchrunRank.from_env({}, node_rank=0, world_size=4)
    with pytest.raises(ValueError, match="tp\\*pp = 2"):
        TorchrunRank.from_env(_env(0), node_rank=0, world_size=2)


def test_data_parallel_plan_splits_gpus_and_cores() -> None:
    gpu = ReplicaConfig(model_dir="m", tp=2, pp=1, device="auto")
    plan = plan_data_parallel(gpu, 2, cpu_count=16, gpu_count=4)
    assert [gpus for _, gpus in plan] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="--device auto needs one GPU per rank"):
        plan_data_parallel(gpu, 2, cpu_count=16, gpu_count=2)  # too few GPUs: refused
    cpu = plan_data_parallel(gpu, 2, cpu_count=16, gpu_count=0)  # no GPU at all: CPU
    assert [(c.device, c.threads_per_rank, g) for c, g in cpu] == [("cpu", 4, None)] * 2
    assert plan_data_parallel(gpu, 1, cpu_count=16, gpu_count=4) == [(gpu, None)]
    with pytest.raises(ValueError, match="dp\\*tp\\*pp = 4 but 2 CUDA"):
        plan_data_parallel(ReplicaConfig(model_dir="m", tp=2, device="cuda"), 2, 16, 2)
    with pytest.raises(ValueError, match="--data-parallel-size must be >= 1"):
        plan_data_parallel(gpu, 0)
