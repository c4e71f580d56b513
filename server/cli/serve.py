"""``shardserve serve``: validate flags, start the replicas, serve HTTP until told to stop.

``shardserve serve`` spawns ``-dp`` replicas of ``-tp * -pp`` ranks itself,
each on its own ``ipc://`` address, behind one router (:mod:`server.engine.router`), with a
fresh engine token per run in the ranks' environment (:mod:`server.cli.engine_token`);
``shardserve serve --engine tcp://HOST:PORT`` (repeatable, one per replica)
spawns nothing and serves replicas started elsewhere by ``shardserve engine``
(:mod:`server.cli.engine`), which it never shuts down.

Start-up order, so a mistake costs nothing: parse flags (:mod:`server.cli.args`;
a bad value exits 2 naming it) → check their combinations and validate the
replica config, load the tokenizer and compile its chat template (a
``ValueError`` prints ``shardserve: error: <message>`` and exits 2, nothing
spawned) → bind the HTTP socket (a busy port fails here, still nothing
spawned) → validate the checkpoint and the devices, spawn the replicas'
ranks → wait for every ``EngineReady`` (exit 1 naming the ranks'
exit codes if one dies first, or after ``READY_TIMEOUT_S``) → run uvicorn.

The checks, the spawning and the app it shares with ``run-batch`` are
:mod:`server.cli.startup`'s.

Serving: each spawned replica is watched by a
:class:`~server.engine.supervisor.ReplicaSupervisor` (a dead rank is restarted with
its replica, up to ``--max-restarts`` times, requests replayed);
``--max-queued-requests``/``--max-queued-tokens`` shed load with 429s and
``--request-timeout`` ends long requests (:mod:`server.http.limits`).

Stopping: the first SIGINT/SIGTERM drains (:mod:`server.http.lifecycle`): new
requests get a 503, requests in flight finish for up to
``--shutdown-timeout`` seconds, then uvicorn stops (a second signal stops at
once); whatever the way out (signal during start-up included), ``Shutdown`` is sent to the replicas
this process started and ``handle.stop()`` reaps every rank in a ``finally``.
A signal arriving while the ranks are being spawned is held until the
handles exist.

torch is never imported here: ``model_shards.launch.replicas`` is imported only when a
replica is started. Without ``--model`` the packaged SmolLM2 GGUF is served
(:mod:`model_shards.launch.packaged_model`), named ``SmolLM2-135M-Instruct``.
``shardserve bench`` runs the load generator (``BENCH_MODULE``), imported by name only for
that subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from server.cli.args import build_parser
from server.cli.signals import ServeState, SignalGuard, Stop, raise_if_signalled
from server.cli.startup import (
    READY_TIMEOUT_S,
    ReplicaHandle,
    app_from_flags,
    check_start_up,
    error,
    replica_clients,
    start_own_replicas,
)
from server.http.request_context import RequestIdFilter
from server.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from server.engine.router import Router
    from server.http.draining import DrainingServer
    from server.http.metrics import Metrics

logger = logging.getLogger("shardserve")

GRACEFUL_SHUTDOWN_S = 5
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
BENCH_MODULE = "deploy.loadtest"  # what ``shardserve bench`` runs


def main(argv: list[str] | None = None) -> int:
    """Console script ``shardserve``; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    if args.command in ("engine", "ping"):
        from server.cli.engine import run_engine, run_ping

        return run_engine(args) if args.command == "engine" else run_ping(args)
    if args.command == "run-batch":
        from server.cli.run_batch import run_batch

        return run_batch(args)
    return serve(args)


def _run_bench(argv: list[str]) -> int:
    """``shardserve bench ARGS``: the load generator's ``main(ARGS)`` (it owns its flags),
    imported by name only here, so that the server never imports its load tester."""
    return int(importlib.import_module(BENCH_MODULE).main(argv))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only then (Nagle cost ~40 ms of every TTFT)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def serve(args: argparse.Namespace) -> int:
    """Run the ``serve`` command; see the module docstring for the order of events."""
    state = ServeState()
    guard = SignalGuard(state)
    handles: Sequence[ReplicaHandle] = ()
    try:
        try:
            config, tokenizer, name = check_start_up(args)
        except ValueError as exc:
            error(str(exc))
            return 2
        try:
            sock = _bind(args.host, args.port)
        except OSError as exc:
            error(f"--host {args.host} --port {args.port}: cannot listen ({exc.strerror or exc})")
            return 2
        with sock:
            try:
                handles = start_own_replicas(args, config, guard)
            except ValueError as exc:
                error(str(exc))
                return 2
            return asyncio.run(_serve_async(args, handles, tokenizer, name, sock, state))
    except Stop as stop:
        if state.serving:
            logger.info("stopped by %s", stop)
            return 0
        error(f"interrupted by {stop} during start-up")
        return 128 + stop.signum
    finally:
        guard.ignore()
        try:
            if handles:
                logger.info("stopping %d replica(s)", len(handles))
            for started in handles:
                started.stop()
        finally:
            guard.restore()


async def _serve_async(
    args: argparse.Namespace,
    handles: Sequence[ReplicaHandle],
    tokenizer: Tokenizer,
    name: str,
    sock: socket.socket,
    state: ServeState,
) -> int:
    """Connect to the replicas (``handles``, else ``args.engine``), then serve HTTP on
    ``sock`` until stopped (0); 1 if a replica dies or times out before it is ready."""
    from server.engine.client import EngineDeadError
    from server.engine.router import Router
    from server.engine.stats import EngineStatsBoard
    from server.http.metrics import Metrics

    metrics = Metrics()
    router = Router(replica_clients(args, handles, EngineStatsBoard(metrics)), metrics)
    try:
        try:
            ready = await router.connect(timeout_s=READY_TIMEOUT_S)
        except (EngineDeadError, TimeoutError) as exc:
            codes = f"; rank exit codes: {_exitcodes(handles)}" if handles else ""
            error(f"{exc}{codes}")
            return 1
        server = _http_server(args, router, tokenizer, name, ready.max_model_len, metrics)
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d", name, f"[{host}]" if ":" in host else host, port)
        raise_if_signalled(state)  # a signal during that log call was dropped by logging
        state.serving = True
        await server.serve(sockets=[sock])
        return 0
    finally:
        await router.close(send_shutdown=bool(handles))  # never stop another's --engine


def _http_server(
    args: argparse.Namespace,
    router: Router,
    tokenizer: Tokenizer,
    name: str,
    max_model_len: int,
    metrics: Metrics,
) -> DrainingServer:
    """The OpenAI-compatible app over ``router`` with the flags' limits, in a uvicorn
    server that drains requests in flight on the first signal."""
    import uvicorn

    from server.http.draining import DrainingServer
    from server.http.lifecycle import Lifecycle

    lifecycle = Lifecycle()
    app = app_from_flags(args, router, tokenizer, name, max_model_len, metrics, lifecycle)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=False,  # the front door logs each request with its id
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    return DrainingServer(config, lifecycle, args.shutdown_timeout)


def _exitcodes(handles: Sequence[ReplicaHandle]) -> str:
    def ranks(handle: ReplicaHandle) -> str:
        codes = handle.exitcodes()
        return ", ".join(f"rank {r}: {'running' if c is None else c}" for r, c in enumerate(codes))

    if len(handles) == 1:
        return ranks(handles[0])
    return "; ".join(f"replica {i}: {ranks(h)}" for i, h in enumerate(handles))


if __name__ == "__main__":
    sys.exit(main())
