"""``shardserve serve``: validate flags, start the replicas, serve HTTP until told to stop.

``shardserve serve`` spawns ``-dp`` replicas of ``-tp * -pp`` ranks itself,
each on its own ``ipc://`` address, behind one router (:mod:`server.router`);
``shardserve serve --engine tcp://HOST:PORT`` (repeatable, one per replica)
spawns nothing and serves replicas started elsewhere by ``shardserve engine``
(:mod:`server.engine_command`), which it never shuts down.

Start-up order, so a mistake costs nothing: parse flags → validate the
replica config, load the tokenizer and compile its chat template (a
``ValueError`` prints
``shardserve: error: <message>`` and exits 2, nothing spawned) → bind the
HTTP socket (a busy port fails here, still nothing spawned) → spawn the
replicas' ranks → wait for every ``EngineReady`` (exit 1 naming the ranks'
exit codes if one dies first, or after ``READY_TIMEOUT_S``) → run uvicorn.

Serving: each spawned replica is watched by a
:class:`~server.supervisor.ReplicaSupervisor` (a dead rank is restarted with
its replica, up to ``--max-restarts`` times, requests replayed);
``--max-queued-requests``/``--max-queued-tokens`` shed load with 429s and
``--request-timeout`` ends long requests (:mod:`server.limits`).

Stopping: the first SIGINT/SIGTERM drains (:mod:`server.lifecycle`): new
requests get a 503, requests in flight finish for up to
``--shutdown-timeout`` seconds, then uvicorn stops (a second signal stops at
once); whatever the way out (signal during start-up included), ``Shutdown`` is sent to the replicas
this process started and ``handle.stop()`` reaps every rank in a ``finally``.
A signal arriving while the ranks are being spawned is held until the
handles exist.

torch is never imported here: ``model_shards.launch`` and
``model_shards.default_model`` are imported only inside :func:`serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from model_shards.config import ReplicaConfig
from server.chat_template import ChatTemplate
from server.cli_args import build_parser
from server.request_context import RequestIdFilter
from server.supervisor import SpawnedReplica
from server.tokenizer import Tokenizer

logger = logging.getLogger("shardserve")

READY_TIMEOUT_S = 300.0
HEARTBEAT_S = 5.0  # how often a frontend pings an --engine it did not start
HEARTBEAT_TIMEOUT_S = 60.0  # silence after which that engine counts as dead
DEFAULT_MODEL_NAME = "shardserve-default"
GRACEFUL_SHUTDOWN_S = 5
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"


ReplicaHandle = SpawnedReplica  # what the CLI uses of model_shards.launch.ReplicaHandle


def main(argv: list[str] | None = None) -> int:
    """Console script ``shardserve``; returns the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the load generator owns its flags (deploy/loadtest.py)
        from deploy.loadtest import main as loadtest_main

        return loadtest_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
    if args.command in ("engine", "ping"):
        from server.engine_command import run_engine, run_ping

        return run_engine(args) if args.command == "engine" else run_ping(args)
    return serve(args)


class _Stop(Exception):
    """Raised in the main thread by SIGINT/SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _SignalGuard:
    """SIGINT/SIGTERM → :class:`_Stop`, optionally held back during a critical section."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._held: int | None = None
        self._holding = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._holding:
            self._held = self._held or signum
        else:
            raise _Stop(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Signals arriving inside the block are raised when it ends."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._held is not None:
            raise _Stop(self._held)

    def ignore(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class _State:
    serving: bool = False  # uvicorn started: a signal from now on is a normal stop


def _error(message: str) -> None:
    print(f"shardserve: error: {message}", file=sys.stderr, flush=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def replica_config(args: argparse.Namespace) -> ReplicaConfig:
    """The replica the flags describe (not validated); the default model if no ``--model``."""
    if args.model is None:
        from model_shards.default_model import ensure_default_model

        model_dir = str(ensure_default_model())
    else:
        model_dir = args.model
    return ReplicaConfig(
        model_dir=model_dir,
        tp=args.tensor_parallel_size,
        pp=args.pipeline_parallel_size,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant,
        enable_prefix_caching=args.prefix_caching,
        pipeline_overlap=args.pipeline_overlap,
        pp_layer_partition=args.pp_layer_partition,
    )


def _check_engine_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming the flag when ``--engine`` is misused."""
    for address in args.engine:
        if not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--engine {address}: expected tcp://HOST:PORT or ipc://PATH")
    if args.engine and args.data_parallel_size != 1:
        raise ValueError(
            "--data-parallel-size starts replicas; with --engine, give one --engine per replica"
        )


def serve(args: argparse.Namespace) -> int:
    """Run the ``serve`` command; see the module docstring for the order of events."""
    guard = _SignalGuard()
    handles: Sequence[ReplicaHandle] = ()
    state = _State()
    try:
        config = replica_config(args)
        model_dir = config.model_dir
        default_name = DEFAULT_MODEL_NAME if args.model is None else Path(model_dir).resolve().name
        name = args.served_model_name or default_name
        try:
            _check_engine_flags(args)
            if not args.engine:  # an --engine replica was validated by its own command
                config.validate()
            tokenizer = Tokenizer.from_dir(model_dir)
            if tokenizer.chat_template is not None:  # compiles, or exit 2 before spawning
                ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens)
        except ValueError as exc:
            _error(str(exc))
            return 2
        try:
            sock = _bind(args.host, args.port)
        except OSError as exc:
            _error(f"--host {args.host} --port {args.port}: cannot listen ({exc.strerror or exc})")
            return 2
        with sock:
            if not args.engine:
                from model_shards.launch import start_replicas

                try:
                    with guard.held():  # validates again (checkpoint, devices)
                        handles = start_replicas(config, args.data_parallel_size)
                except ValueError as exc:
                    _error(str(exc))
                    return 2
                for i, handle in enumerate(handles):
                    logger.info(
                        "started replica %d tp=%d pp=%d at %s; rank pids %s", i, config.tp,
                        config.pp, handle.address, handle.pids(),
                    )  # fmt: skip
            return asyncio.run(_serve_async(args, handles, tokenizer, name, sock, state))
    except _Stop as stop:
        if state.serving:
            logger.info("stopped by %s", stop)
            return 0
        _error(f"interrupted by {stop} during start-up")
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
    state: _State,
) -> int:
    """Connect to the replicas (``handles``, else ``args.engine``), then run uvicorn."""
    import uvicorn

    from server.app import build_app
    from server.draining import DrainingServer
    from server.engine_client import EngineClient, EngineDeadError
    from server.engine_stats import EngineStatsBoard
    from server.lifecycle import Lifecycle
    from server.limits import Admission
    from server.metrics import Metrics
    from server.router import Replica, Router
    from server.supervisor import ReplicaSupervisor

    window_s = args.batch_window_ms / 1000
    metrics = Metrics()
    board = EngineStatsBoard(metrics)

    def spawned_client(replica: int) -> Callable[[SpawnedReplica], EngineClient]:
        def make(handle: SpawnedReplica) -> EngineClient:
            return EngineClient(
                handle.address, is_alive=handle.is_alive, describe_death=handle.death,
                batch_window_s=window_s, on_stats=board.reporter(replica),
            )  # fmt: skip

        return make

    replicas: list[Replica] = [
        ReplicaSupervisor(
            h, spawned_client(i), name=f"replica {i}", max_restarts=args.max_restarts,
            ready_timeout_s=READY_TIMEOUT_S, on_down=lambda i=i: board.forget(i),  # type: ignore[misc]
        )
        for i, h in enumerate(handles)
    ] or [
        EngineClient(
            address, batch_window_s=window_s, heartbeat_s=HEARTBEAT_S,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, on_stats=board.reporter(i),
        )
        for i, address in enumerate(args.engine)
    ]  # fmt: skip
    router = Router(replicas, metrics)
    try:
        try:
            ready = await router.connect(timeout_s=READY_TIMEOUT_S)
        except (EngineDeadError, TimeoutError) as exc:
            codes = f"; rank exit codes: {_exitcodes(handles)}" if handles else ""
            _error(f"{exc}{codes}")
            return 1
        lifecycle = Lifecycle()
        app = build_app(
            router,
            tokenizer,
            name,
            ready.max_model_len,
            api_key=args.api_key,
            max_request_bytes=args.max_request_bytes,
            metrics=metrics,
            admission=Admission(args.max_queued_requests, args.max_queued_tokens),
            request_timeout_s=args.request_timeout,
            lifecycle=lifecycle,
        )
        config = uvicorn.Config(
            app,
            log_level=args.log_level,
            access_log=False,  # the front door logs each request with its id
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = DrainingServer(config, lifecycle, args.shutdown_timeout)
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d", name, f"[{host}]" if ":" in host else host, port)
        state.serving = True
        await server.serve(sockets=[sock])
        return 0
    finally:
        await router.close(send_shutdown=bool(handles))  # never stop another's --engine


def _exitcodes(handles: Sequence[ReplicaHandle]) -> str:
    def ranks(handle: ReplicaHandle) -> str:
        codes = handle.exitcodes()
        return ", ".join(f"rank {r}: {'running' if c is None else c}" for r, c in enumerate(codes))

    if len(handles) == 1:
        return ranks(handles[0])
    return "; ".join(f"replica {i}: {ranks(h)}" for i, h in enumerate(handles))


if __name__ == "__main__":
    sys.exit(main())
