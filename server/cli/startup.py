"""What ``serve`` and ``run-batch`` share: start-up checks, spawning, the router's clients.

:func:`check_start_up` makes every check that needs neither a socket nor a process (the
flags, the replica config, the tokenizer and its chat template: a ``ValueError`` naming the
flag); :func:`start_replicas` spawns the replicas (torch comes in only here, with
``model_shards.launch``); :func:`replica_clients` is what the router routes to;
:func:`app_from_flags` is the OpenAI-compatible app the flags describe.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from model_shards.config.model import ModelConfig, load_model_config
from model_shards.config.replica import ReplicaConfig
from model_shards.launch.packaged_model import SERVED_NAME
from server.api.lora import LoraRegistry
from server.cli.engine_token import check_engine_token, export_engine_token, new_engine_token
from server.cli.flag_checks import check_serve_flags, replica_config
from server.cli.signals import SignalGuard
from server.engine.supervisor import SpawnedReplica
from server.media.multimodal import ImageModel, media_options
from server.text.chat_template import ChatTemplate
from server.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from fastapi import FastAPI

    from server.engine.router import Replica, Router
    from server.engine.stats import EngineStatsBoard
    from server.http.lifecycle import Lifecycle
    from server.http.metrics import Metrics

logger = logging.getLogger("shardserve")

READY_TIMEOUT_S = 300.0
HEARTBEAT_S = 5.0  # how often a frontend pings an --engine it did not start
HEARTBEAT_TIMEOUT_S = 60.0  # silence after which that engine counts as dead

ReplicaHandle = SpawnedReplica  # what the CLI uses of model_shards.launch.replicas.ReplicaHandle


def error(message: str) -> None:
    print(f"shardserve: error: {message}", file=sys.stderr, flush=True)


def check_start_up(args: argparse.Namespace) -> tuple[ReplicaConfig, Tokenizer, str]:
    """Every check that needs neither a socket nor a process: the flags, the replica,
    the tokenizer and its chat template; ``ValueError`` naming the flag. Returns the
    replica's config, the tokenizer and the model name served in the API."""
    check_serve_flags(args)
    config = replica_config(args)
    if args.engine:  # that replica was validated by its own command; these flags go unused
        config.check_flags()
        check_engine_token(args.engine_token, "with --engine (the engine's own)")
    else:
        config.validate()
    if args.tokenizer is not None:
        tokenizer = Tokenizer.from_dir(args.tokenizer, flag="--tokenizer")
    else:
        tokenizer = Tokenizer.from_dir(config.model_dir)
    args.image_model = ImageModel.from_dir(config.model_dir)  # or exit 2 before spawning
    if tokenizer.chat_template is not None:  # compiles, or exit 2 before spawning
        ChatTemplate(tokenizer.chat_template, tokenizer.special_tokens)
    return config, tokenizer, served_name(args)


def served_name(args: argparse.Namespace) -> str:
    """``--served-model-name``, else the packaged model's name without ``--model``, else the
    ``--model`` directory's name (a GGUF file's, less ``.gguf``)."""
    if args.served_model_name:
        return str(args.served_model_name)
    if args.model is None:
        return SERVED_NAME
    path = Path(args.model).resolve()
    return path.stem if path.suffix == ".gguf" and path.is_file() else path.name


def start_own_replicas(
    args: argparse.Namespace, config: ReplicaConfig, guard: SignalGuard
) -> Sequence[ReplicaHandle]:
    """Without ``--engine``: draw this run's engine token (the ranks inherit it) and spawn the
    replicas with signals held; with it, none (``ValueError`` as :func:`start_replicas`)."""
    if args.engine:
        return ()
    args.engine_token = new_engine_token()
    export_engine_token(args.engine_token)
    with guard.held():
        return start_replicas(config, args.data_parallel_size)


def start_replicas(config: ReplicaConfig, dp: int) -> Sequence[ReplicaHandle]:
    """Spawn ``dp`` replicas of ``config`` (``ValueError`` first if the checkpoint or the
    devices do not fit: ``start_replicas`` validates again) and log their ranks. With
    ``--dp-attention`` the ``dp`` replicas are one world sharing their experts."""
    if config.dp_attention:
        from model_shards.launch.dp_attention import start_dp_attention as start
    else:
        from model_shards.launch.replicas import start_replicas as start

    handles = start(config, dp)
    for i, handle in enumerate(handles):
        logger.info(
            "started replica %d tp=%d pp=%d at %s; rank pids %s",
            i,
            config.tp,
            config.pp,
            handle.address,
            handle.pids(),
        )
    return handles


def replica_clients(
    args: argparse.Namespace, handles: Sequence[ReplicaHandle], board: EngineStatsBoard
) -> list[Replica]:
    """What the router routes to: a supervisor per spawned replica (restarting it when a
    rank dies), else a heartbeating client per ``--engine``."""
    from server.engine.client import EngineClient
    from server.engine.supervisor import ReplicaSupervisor

    window_s = args.batch_window_ms / 1000

    def spawned_client(replica: int) -> Callable[[SpawnedReplica], EngineClient]:
        def make(handle: SpawnedReplica) -> EngineClient:
            return EngineClient(
                handle.address,
                is_alive=handle.is_alive,
                describe_death=handle.death,
                batch_window_s=window_s,
                on_stats=board.reporter(replica),
                token=args.engine_token,
            )

        return make

    if handles:
        return [
            ReplicaSupervisor(
                h,
                spawned_client(i),
                name=f"replica {i}",
                max_restarts=args.max_restarts,
                ready_timeout_s=READY_TIMEOUT_S,
                on_down=lambda i=i: board.forget(i),  # type: ignore[misc]
            )
            for i, h in enumerate(handles)
        ]
    return [
        EngineClient(
            address,
            batch_window_s=window_s,
            heartbeat_s=HEARTBEAT_S,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            on_stats=board.reporter(i),
            token=args.engine_token,
        )
        for i, address in enumerate(args.engine)
    ]


def app_from_flags(
    args: argparse.Namespace,
    router: Router,
    tokenizer: Tokenizer,
    name: str,
    max_model_len: int,
    metrics: Metrics,
    lifecycle: Lifecycle | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over ``router`` with the flags' limits and parsers."""
    from server.http.app import build_app
    from server.http.limits import Admission

    return build_app(
        router,
        tokenizer,
        name,
        max_model_len,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        metrics=metrics,
        admission=Admission(args.max_queued_requests, args.max_queued_tokens),
        request_timeout_s=args.request_timeout,
        lifecycle=lifecycle,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        image_model=args.image_model,
        media_options=media_options(args),
        disable_docs=args.disable_fastapi_docs,
        scheduling_policy=args.scheduling_policy,
        loras=lora_registry(args, name),
    )


def lora_registry(args: argparse.Namespace, name: str) -> LoraRegistry | None:
    """With ``--enable-lora``: the adapters of ``--lora-modules`` (checked by
    :func:`check_start_up`), served beside the base model ``name``."""
    config = replica_config(args)
    options = config.lora_options()
    if options is None:
        return None
    model = load_model_config(config.model_dir)
    if not isinstance(model, ModelConfig):
        raise ValueError("--enable-lora: encoder (embedding) models take no adapters")
    return LoraRegistry(model, name, options)
