"""``shardserve engine`` and ``shardserve ping``: a replica without a frontend, and its probe.

``shardserve engine`` runs this node's ranks of one replica under
``torchrun`` (:mod:`model_shards.torchrun_worker`); rank 0 binds the ZMQ
ROUTER at ``tcp://--engine-host:--engine-port`` for frontends started with
``shardserve serve --engine tcp://HOST:PORT``. Flags are validated first
(exit 2 naming the flag, nothing started); then the process *becomes*
torchrun (``exec``), so signals reach torchrun, which stops its workers. The
replica stops on SIGTERM; frontends never shut it down.

``shardserve ping ADDRESS`` sends ``Hello`` and exits 0 once the engine
answers ``EngineReady`` (the model is loaded), 1 after ``--timeout``: a
container healthcheck or readiness probe for an engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("shardserve")

DEFAULT_ENGINE_PORT = 5555


def add_engine_parser(
    commands: Any, add_replica_flags: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add the ``engine`` and ``ping`` sub-commands to ``commands`` (argparse subparsers)."""
    engine = commands.add_parser(
        "engine", help="run one replica's ranks under torchrun (this node's share of them)"
    )
    add_replica_flags(engine)
    net = engine.add_argument_group("where frontends connect (rank 0's ZMQ ROUTER)")
    net.add_argument(
        "--engine-host", default="0.0.0.0",
        help="interface rank 0 binds (default 0.0.0.0: reachable from other hosts; the "
        "protocol has no authentication, keep it on a private network)",
    )  # fmt: skip
    net.add_argument("--engine-port", type=int, default=DEFAULT_ENGINE_PORT)
    nodes = engine.add_argument_group("several nodes (torchrun, c10d rendezvous)")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes this replica spans")
    nodes.add_argument("--node-rank", type=int, default=0, help="0 runs the coordinator")
    nodes.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT",
        help="c10d rendezvous, the same on every node (default with one node: --standalone)",
    )  # fmt: skip
    nodes.add_argument("--rdzv-id", default="shardserve", help="names this replica's rendezvous")

    ping = commands.add_parser("ping", help="exit 0 when the engine at ADDRESS is ready")
    ping.add_argument("address", metavar="ADDRESS", help="tcp://HOST:PORT or ipc://PATH")
    ping.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    ping.add_argument("--log-level", default="warning")


def run_engine(args: argparse.Namespace) -> int:
    """Validate, then ``exec`` torchrun; returns only on a flag error (2)."""
    from model_shards.launch import validate_replica
    from model_shards.torchrun_worker import NodeLayout, torchrun_command
    from server.cli import replica_config

    layout = NodeLayout(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id)
    try:
        config = replica_config(args)
        nproc = layout.nproc_per_node(config.tp * config.pp)
        validate_replica(config, local_world_size=nproc)
        if not 0 < args.engine_port < 65536:
            raise ValueError(f"--engine-port must be in 1..65535, got {args.engine_port}")
    except ValueError as exc:
        print(f"shardserve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    address = f"tcp://{args.engine_host}:{args.engine_port}"
    command = torchrun_command(config, address, layout)
    logger.info(
        "node %d/%d: %d rank(s) of tp=%d pp=%d; rank 0 serves %s",
        layout.node_rank, layout.nnodes, nproc, config.tp, config.pp, address,
    )  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
    return 0  # not reached


def run_ping(args: argparse.Namespace) -> int:
    """0 when ``args.address`` answers ``Hello`` with ``EngineReady`` in time, else 1."""
    import zmq

    from model_shards.messages import EngineReady, Hello, decode_engine_message, encode

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(args.address)
        sock.send(encode(Hello()))
        if sock.poll(int(args.timeout * 1000)) and isinstance(
            decode_engine_message(sock.recv_multipart()[-1]), EngineReady
        ):
            return 0
        print(f"shardserve: engine at {args.address} not ready", file=sys.stderr)
        return 1
    finally:
        sock.close()
        ctx.term()
