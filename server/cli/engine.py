"""``shardserve engine`` and ``shardserve ping``: a replica without a frontend, and its probe.

``shardserve engine`` runs this node's ranks of one replica under
``torchrun`` (:mod:`model_shards.launch.torchrun`); rank 0 binds the ZMQ
ROUTER at ``tcp://--engine-host:--engine-port`` for frontends started with
``shardserve serve --engine tcp://HOST:PORT``; both sides share the engine token
(``--engine-token`` or ``$SHARDSERVE_ENGINE_TOKEN``: rank 0 serves only connections whose
``Hello`` carried it). Flags are validated first
(exit 2 naming the flag, nothing started: the layout, the replica as
``shardserve serve`` validates it, then on node 0 the token and whether it can listen on
``--engine-host``/``--engine-port``); then the process *becomes*
torchrun (``exec``), so signals reach torchrun, which stops its workers. The
replica stops on SIGTERM; frontends never shut it down.

``shardserve ping ADDRESS`` sends ``Hello`` (with the token) and exits 0 once the engine
answers ``EngineReady`` (the model is loaded), 1 after ``--timeout``: a
container healthcheck or readiness probe for an engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from dataclasses import replace

from server.cli.engine_token import check_engine_token, export_engine_token
from server.cli.flag_checks import engine_address_problem, replica_config

logger = logging.getLogger("shardserve")


def run_engine(args: argparse.Namespace) -> int:
    """Validate, then ``exec`` torchrun; returns only on a flag error (2)."""
    from model_shards.launch.replicas import validate_replica
    from model_shards.launch.torchrun import NodeLayout, address_towards, torchrun_command

    layout = NodeLayout(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id)
    try:
        nproc = layout.nproc_per_node(args.tensor_parallel_size * args.pipeline_parallel_size)
        if layout.rdzv_endpoint:  # the stores of this node listen on that address only
            layout = replace(layout, local_addr=address_towards(layout.rdzv_endpoint))
        config = replica_config(args)
        validate_replica(config, local_world_size=nproc)
        if layout.node_rank == 0:  # rank 0, which binds the ROUTER, runs on node 0
            _check_can_listen(args.engine_host, args.engine_port)
            if layout.rdzv_endpoint:  # node 0 hosts the rendezvous: on that host, that port
                host, _, port = layout.rdzv_endpoint.rpartition(":")
                _check_can_listen(host.strip("[]"), int(port), "--rdzv-endpoint")
            token = check_engine_token(args.engine_token, "on node 0 (rank 0 checks it)")
            export_engine_token(token)  # torchrun's workers inherit it; no command line shows it
    except ValueError as exc:
        _error(str(exc))
        return 2
    address = f"tcp://{args.engine_host}:{args.engine_port}"
    command = torchrun_command(config, address, layout)
    logger.info(
        "node %d/%d: %d rank(s) of tp=%d pp=%d; rank 0 serves %s",
        layout.node_rank,
        layout.nnodes,
        nproc,
        config.tp,
        config.pp,
        address,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
    return 0  # not reached


def _check_can_listen(host: str, port: int, flag: str = "") -> None:
    """``ValueError`` naming the flags (``flag``, else ``--engine-host``/``--engine-port``)
    when node 0 could not bind ``host:port`` now (a busy port, an address of no interface
    here), so it fails before torchrun starts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _name, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ's bind does
            sock.bind(sockaddr)
    except OSError as exc:
        flags = f"{flag} {host}:{port}" if flag else f"--engine-host {host} --engine-port {port}"
        raise ValueError(f"{flags}: cannot listen ({exc.strerror or exc})") from exc


def _error(message: str) -> None:
    print(f"shardserve: error: {message}", file=sys.stderr, flush=True)


def run_ping(args: argparse.Namespace) -> int:
    """0 when ``args.address`` answers ``Hello`` with ``EngineReady`` in time, else 1
    (2 when it is no engine address)."""
    problem = engine_address_problem(args.address)
    if problem:
        _error(f"ping ADDRESS {args.address}: {problem}")
        return 2
    try:
        token = check_engine_token(args.engine_token, "to ping an engine")
    except ValueError as exc:
        _error(str(exc))
        return 2
    import zmq

    from model_shards.messages import (
        EngineReady,
        Hello,
        decode_engine_message,
        encode,
        random_routing_id,
    )

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, random_routing_id())
    try:
        sock.connect(args.address)
        sock.send(encode(Hello(token)))
        if sock.poll(int(args.timeout * 1000)) and isinstance(
            decode_engine_message(sock.recv_multipart()[-1]), EngineReady
        ):
            return 0
        print(f"shardserve: engine at {args.address} not ready", file=sys.stderr)
        return 1
    finally:
        sock.close()
        ctx.term()
