"""One replica's ranks under ``torchrun``, on one node or several.

:func:`torchrun_command` builds the command ``shardserve engine`` runs on
each node::

    python -m model_shards.launch.torchrun_agent --nnodes N --nproc-per-node tp*pp/N
        --max-restarts 0 --rdzv-backend shardserve --rdzv-endpoint HOST:PORT --rdzv-id ID
        --rdzv-conf is_host=0|1 --local-addr ADDR
        -m model_shards.launch.torchrun --config-json ... --address ... --node-rank R

(torchrun itself, its stores bound to the hosts they name: :mod:`.torchrun_agent`; node 0
hosts the rendezvous; ``ADDR`` is this node's address towards the rendezvous host) and each
worker process torchrun starts runs :func:`main`, which calls
:func:`model_shards.launch.rank_process.run_torchrun_rank` (the same rank body as a
replica spawned by ``shardserve serve``). A single node with no rendezvous
endpoint hosts its own on ``127.0.0.1`` (a free port). torchrun ignores ``--node-rank`` under c10d
(it orders nodes itself), so the node rank goes to the workers instead,
which derive the replica rank from it (see
:class:`model_shards.launch.rank_process.TorchrunRank`). The replica's configuration travels as the
JSON of :class:`~model_shards.config.replica.ReplicaConfig`, so every node runs the
exact flags its ``shardserve engine`` validated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys

from model_shards.config.replica import ReplicaConfig
from model_shards.launch.rank_process import run_torchrun_rank


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """Where this node sits in the replica: ``nnodes`` nodes, this one ``node_rank``."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous (node 0's address)
    rdzv_id: str = "shardserve"
    local_addr: str | None = None  # this node's address for the others (its stores bind it)

    def nproc_per_node(self, world_size: int) -> int:
        """Ranks per node; ``ValueError`` naming the flags when they do not fit."""
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if world_size % self.nnodes:
            raise ValueError(
                f"--nnodes {self.nnodes} does not divide tp*pp = {world_size}; every node runs "
                f"the same number of ranks"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (reachable by all)")
        return world_size // self.nnodes


def torchrun_command(
    config: ReplicaConfig, address: str, layout: NodeLayout, python: str = sys.executable
) -> list[str]:
    """The ``torchrun`` command line that runs this node's ranks of the replica."""
    nproc = layout.nproc_per_node(config.world_size)
    command = [
        python,
        "-m",
        "model_shards.launch.torchrun_agent",
        "--nnodes",
        str(layout.nnodes),
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "--rdzv-backend",
        "shardserve",
        "--rdzv-endpoint",
        layout.rdzv_endpoint or "127.0.0.1:0",  # one node: its own store, any free port
        "--rdzv-id",
        layout.rdzv_id,
        "--rdzv-conf",
        f"is_host={int(layout.node_rank == 0)}",
        "--local-addr",
        layout.local_addr or "127.0.0.1",
    ]
    config_json = json.dumps(dataclasses.asdict(config))
    return [
        *command,
        "-m",
        "model_shards.launch.torchrun",
        "--config-json",
        config_json,
        "--address",
        address,
        "--node-rank",
        str(layout.node_rank),
    ]


def address_towards(endpoint: str) -> str:
    """This machine's address on the route to ``HOST:PORT`` (no packet is sent); ``ValueError``
    naming ``--rdzv-endpoint`` when the host does not resolve."""
    host, _, port = endpoint.rpartition(":")
    try:
        family, _kind, _proto, _name, address = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ValueError(f"--rdzv-endpoint {endpoint}: {exc.strerror or exc}") from exc


def main(argv: list[str] | None = None) -> None:
    """Entry point of one torchrun worker process."""
    parser = argparse.ArgumentParser(prog="model_shards.launch.torchrun")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    args = parser.parse_args(argv)
    config = ReplicaConfig(**json.loads(args.config_json))
    run_torchrun_rank(config, args.address, args.node_rank)


if __name__ == "__main__":
    main()
