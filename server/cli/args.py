"""The ``shardserve`` command line: every subcommand's flags and their parsers.

``serve``, ``run-batch`` (serve's flags and its files) and ``engine`` share the replica
flags (:func:`add_replica_flags`, turned into a
:class:`~model_shards.config.replica.ReplicaConfig` by
:func:`server.cli.flag_checks.replica_config`); ``serve``
adds the HTTP, data-parallel and resilience flags, ``engine`` where frontends connect and
the torchrun nodes. A bad value is an argparse error naming the flag (exit 2); a bad
combination is a ``ValueError`` naming the flags (:mod:`server.cli.flag_checks`, then
``ReplicaConfig.validate``), before anything starts.

Imports run one way: ``server.cli.serve`` → ``server.cli.engine`` → ``flag_checks`` → this
module.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from model_shards.config.replica import (
    DTYPE_CHOICES,
    KV_CACHE_DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
)
from model_shards.config.scheduler import SCHEDULING_POLICIES
from server.cli.engine_token import add_engine_token_flag
from server.cli.flag_types import host_port as _host_port
from server.cli.flag_types import listen_port as _listen_port
from server.cli.flag_types import non_empty as _non_empty
from server.cli.flag_types import non_negative_float as _non_negative_float
from server.cli.flag_types import non_negative_int as _non_negative_int
from server.cli.flag_types import port as _port
from server.cli.flag_types import positive_float as _positive_float
from server.cli.flag_types import positive_int as _positive_int
from server.cli.flag_types import size as _size
from server.cli.frontend_flags import add_output_parser_flags, add_run_batch_flags
from server.http.middleware import DEFAULT_MAX_REQUEST_BYTES
from server.media.multimodal import add_media_flags

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
API_KEY_ENV = "SHARDSERVE_API_KEY"
MODEL_ENV = "SHARDSERVE_MODEL"
DEFAULT_ENGINE_PORT = 5555
ENGINE_ADDRESS_FORMS = "tcp://HOST:PORT or ipc://PATH"


def add_replica_flags(command: argparse.ArgumentParser) -> None:
    """Flags that describe one replica (both ``serve`` and ``engine`` take them)."""
    command.add_argument(
        "--model",
        default=os.environ.get(MODEL_ENV) or None,
        help=f"checkpoint directory or GGUF file (default: ${MODEL_ENV}, else SmolLM2-135M)",
    )
    command.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    command.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="M")
    command.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    command.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    command.add_argument("--max-num-seqs", type=int, default=64)
    command.add_argument("--max-model-len", type=int, default=None)
    command.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    engine = _engine_group(command)
    engine.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="T")
    engine.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    engine.add_argument(
        "--kv-cache-memory",
        type=_size,
        default=None,
        metavar="SIZE",
        help="KV cache bytes per rank, e.g. 2GiB (default: GPU memory utilization, or 1GiB on CPU)",
    )
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    engine.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs: first come first served; priority: requests' `priority` field, lower first "
        "(a running lower-priority request may be preempted)",
    )
    engine.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="turn off automatic prefix caching",
    )
    _add_step_flags(engine)
    _add_weight_flags(engine)
    _add_lora_flags(command)


def _add_step_flags(engine: Any) -> None:
    """How steps run: pipeline overlap, async scheduling, CUDA graphs, batch invariance."""
    engine.add_argument(
        "--no-pipeline-overlap",
        dest="pipeline_overlap",
        action="store_false",
        help="with -pp > 1, run one micro-batch at a time (for comparison)",
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan each step while the previous one runs, its sampled tokens read on the "
        "device (default: on with CUDA, at -pp 1 without --speculative-config)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step eagerly (no CUDA graphs for decode-only steps)",
    )
    engine.add_argument(
        "--batch-invariant",
        action="store_true",
        help="CUDA: GEMM, attention and RMSNorm with a fixed reduction order, so a row's "
        "output does not depend on its batch (CPU backends always are)",
    )


def _add_lora_flags(command: argparse.ArgumentParser) -> None:
    """vLLM's multi-LoRA flags (``model_shards/config/lora.py`` checks them and each adapter)."""
    lora = command.add_argument_group("LoRA adapters (PEFT format)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters served from start-up; a request names one as its `model`",
    )
    lora.add_argument("--max-loras", type=int, default=1, help="adapters in one batch")
    lora.add_argument("--max-lora-rank", type=int, default=16, metavar="R")
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        metavar="M",
        help="adapters kept in host memory (default: --max-loras)",
    )


def _add_weight_flags(engine: Any) -> None:
    """How the replica holds and splits its weights: experts, stages, quantization; and
    speculative decoding."""
    engine.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": '
        'K, "prompt_lookup_max": N, "prompt_lookup_min": M, "disable_by_batch_size": B}, or a '
        'draft model with the same tokenizer: {"model": DIR_OR_GGUF, "num_speculative_tokens": '
        "K} (greedy proposals at tp=1 on rank 0)",
    )
    engine.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: each TP rank holds experts/tp whole experts, not a slice of each",
    )
    engine.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="decoder models: quantize a dense checkpoint as it loads. q8_0, q4_0 (CPU): every "
        "linear and vocab weight per block (weight-only, GGML's); fp8: linear weights in FP8 "
        "e4m3 with per-channel scales, activations per token (W8A8). GGUF weights stay as stored",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPE_CHOICES,
        default="auto",
        help="K/V pool element: auto (the model's dtype; fp8 on GPU for a checkpoint whose "
        "kv_cache_scheme stores KV scales) or fp8 (e4m3 with per-layer scales from the "
        "checkpoint, else 1.0; one byte per element; CUDA only)",
    )
    engine.add_argument(
        "--pp-layer-partition",
        default="even",
        metavar="SPEC",
        help="layers per pipeline stage: 'even' (default), 'balanced' (equal compute, the LM "
        "head counted on the last stage) or counts such as 19,11",
    )


def _engine_group(command: argparse.ArgumentParser) -> Any:
    """The replica's engine flags' group, with ``--cpu-threads-per-rank``."""
    engine = command.add_argument_group("engine (continuous batching, paged KV cache)")
    engine.add_argument(
        "--cpu-threads-per-rank",
        type=_positive_int,
        default=None,
        metavar="N",
        help="CPU: torch threads in each rank, fixed (default: the usable cores, from the "
        "affinity mask and cgroup quota, less the frontend's share, split among the ranks)",
    )
    engine.add_argument(
        "--grammar-compile-timeout",
        type=_positive_float,
        default=10.0,
        metavar="SECONDS",
        help="a structured-output grammar that takes longer to compile is refused with a 400 "
        "naming its field, and its compile killed (default 10)",
    )
    return engine


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardserve",
        description="shardserve: tensor- and pipeline-parallel OpenAI-compatible inference server",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    # handled in server.cli.serve.main before parsing: the load generator's flags
    commands.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (see `shardserve bench --help`)",
        add_help=False,
    )
    _add_serve_parser(commands)
    _add_run_batch_parser(commands)
    _add_engine_parser(commands)
    _add_ping_parser(commands)
    return parser


def _add_run_batch_parser(commands: Any) -> None:
    batch = commands.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) through the model, as vLLM's"
    )
    add_run_batch_flags(batch)
    _add_serve_flags(batch)  # the engine starts as serve starts it


def _add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    _add_serve_flags(serve)


def _add_serve_flags(serve: Any) -> None:
    add_replica_flags(serve)
    _add_replica_source_flags(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000, help="0 picks a free port")
    serve.add_argument(
        "--served-model-name",
        type=_non_empty,
        help="model name in the API (default: the --model directory's or GGUF file's name)",
    )
    serve.add_argument(
        "--tokenizer",
        type=_non_empty,
        default=None,
        metavar="DIR",
        help="directory with the tokenizer.json (+ tokenizer_config.json) to use instead of "
        "the --model checkpoint's (default: beside --model, else its GGUF metadata)",
    )
    serve.add_argument(
        "--batch-window-ms",
        type=_non_negative_float,
        default=2.0,
        help="how long the frontend gathers requests into one batch while the engine is "
        "busy (an idle engine gets a request at once)",
    )
    serve.add_argument(
        "--api-key",
        type=_non_empty,
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* and the API docs "
        f"(default: ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no /docs, /redoc or /openapi.json (vLLM's flag)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get a 413 (default: 8 MiB)",
    )
    add_output_parser_flags(serve)
    add_media_flags(serve)
    _add_resilience_flags(serve)


def _add_replica_source_flags(serve: Any) -> None:
    """How many replicas ``serve`` starts and how they share experts, or the engines it uses."""
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_positive_int,
        default=1,
        metavar="D",
        help="replicas to start behind this frontend (least-loaded routing)",
    )
    serve.add_argument(
        "--dp-attention",
        action="store_true",
        help="with -dp D --enable-expert-parallel on a MoE model: the D replicas (tp 1) run "
        "attention on their own requests and share the experts (one world, all-to-all)",
    )
    serve.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="tcp://HOST:PORT",
        help="serve a replica started by 'shardserve engine' instead of starting one "
        "(repeat for several replicas); the tokenizer still comes from --model",
    )
    add_engine_token_flag(serve)


def _add_resilience_flags(serve: argparse.ArgumentParser) -> None:
    """Recovery, load shedding, timeouts and draining (``serve`` only)."""
    group = serve.add_argument_group("resilience")
    group.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=3,
        metavar="N",
        help="restart a replica whose rank died at most N times in a row (default 3)",
    )
    group.add_argument(
        "--max-queued-requests",
        type=_positive_int,
        default=None,
        metavar="N",
        help="refuse new requests with 429 while N are outstanding (default: no limit)",
    )
    group.add_argument(
        "--max-queued-tokens",
        type=_positive_int,
        default=None,
        metavar="T",
        help="refuse new requests with 429 while their prompt + max_tokens (embeddings: their "
        "input tokens) would take the outstanding tokens past T (default: no limit)",
    )
    group.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="end a request after SECONDS with a 504 (or an SSE error event) and abort it",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=_non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, let requests in flight finish for up to SECONDS (default 30)",
    )


def _add_engine_parser(commands: Any) -> None:
    engine = commands.add_parser(
        "engine", help="run one replica's ranks under torchrun (this node's share of them)"
    )
    add_replica_flags(engine)
    net = engine.add_argument_group("where frontends connect (rank 0's ZMQ ROUTER)")
    net.add_argument(
        "--engine-host",
        type=_non_empty,
        default="127.0.0.1",
        help="interface rank 0 binds (default 127.0.0.1: this host only; 0.0.0.0 for "
        "frontends on other hosts, on a private network)",
    )
    net.add_argument("--engine-port", type=_listen_port, default=DEFAULT_ENGINE_PORT)
    add_engine_token_flag(net)
    nodes = engine.add_argument_group("several nodes (torchrun, c10d rendezvous)")
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes this replica spans")
    nodes.add_argument("--node-rank", type=int, default=0, help="0 runs the coordinator")
    nodes.add_argument(
        "--rdzv-endpoint",
        type=_host_port,
        metavar="HOST:PORT",
        help="c10d rendezvous, the same on every node (default with one node: --standalone)",
    )
    nodes.add_argument(
        "--rdzv-id", type=_non_empty, default="shardserve", help="names this replica's rendezvous"
    )


def _add_ping_parser(commands: Any) -> None:
    ping = commands.add_parser("ping", help="exit 0 when the engine at ADDRESS is ready")
    ping.add_argument("address", metavar="ADDRESS", help=ENGINE_ADDRESS_FORMS)
    ping.add_argument("--timeout", type=_positive_float, default=5.0, help="seconds (default 5)")
    add_engine_token_flag(ping)
    ping.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
