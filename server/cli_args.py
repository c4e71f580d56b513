"""The ``shardserve`` command line: every subcommand's flags and their parsers.

``serve`` and ``engine`` share the replica flags (:func:`add_replica_flags`);
``serve`` adds the HTTP, data-parallel and resilience flags. A bad value is an
argparse error naming the flag (exit 2), before anything starts.
"""

from __future__ import annotations

import argparse
import os

from model_shards.config import DTYPE_CHOICES, parse_size
from server.middleware import DEFAULT_MAX_REQUEST_BYTES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
API_KEY_ENV = "SHARDSERVE_API_KEY"
MODEL_ENV = "SHARDSERVE_MODEL"


def add_replica_flags(command: argparse.ArgumentParser) -> None:
    """Flags that describe one replica (both ``serve`` and ``engine`` take them)."""
    command.add_argument(
        "--model", default=os.environ.get(MODEL_ENV) or None,
        help=f"checkpoint directory (default: ${MODEL_ENV}, else the built-in tiny Llama)",
    )  # fmt: skip
    command.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    command.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="M")
    command.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto")
    command.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    command.add_argument("--max-num-seqs", type=int, default=64)
    command.add_argument("--max-model-len", type=int, default=None)
    command.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    engine = command.add_argument_group("engine (continuous batching, paged KV cache)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=8192, metavar="T")
    engine.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    engine.add_argument(
        "--kv-cache-memory", type=_size, default=None, metavar="SIZE",
        help="KV cache bytes per rank, e.g. 2GiB (default: GPU memory utilization, or 1GiB on CPU)",
    )  # fmt: skip
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F")
    engine.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false",
        help="turn off automatic prefix caching",
    )  # fmt: skip
    engine.add_argument(
        "--no-pipeline-overlap", dest="pipeline_overlap", action="store_false",
        help="with -pp > 1, run one micro-batch at a time (for comparison)",
    )  # fmt: skip
    engine.add_argument(
        "--enforce-eager", action="store_true",
        help="CUDA: run every step eagerly (no CUDA graphs for decode-only steps)",
    )  # fmt: skip
    engine.add_argument(
        "--batch-invariant", action="store_true",
        help="CUDA: GEMM, attention and RMSNorm with a fixed reduction order, so a row's "
        "output does not depend on its batch (CPU backends always are)",
    )  # fmt: skip
    engine.add_argument(
        "--pp-layer-partition", default="even", metavar="SPEC",
        help="layers per pipeline stage: 'even' (default), 'balanced' (equal compute, the LM "
        "head counted on the last stage) or counts such as 19,11",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardserve",
        description="shardserve: tensor- and pipeline-parallel OpenAI-compatible inference server",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(  # handled in main() before parsing: the load generator owns its flags
        "bench", help="load-test an OpenAI-compatible server (see `shardserve bench --help`)",
        add_help=False,
    )  # fmt: skip
    serve = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_replica_flags(serve)
    serve.add_argument(
        "--data-parallel-size", "-dp", type=_positive_int, default=1, metavar="D",
        help="replicas to start behind this frontend (least-loaded routing)",
    )  # fmt: skip
    serve.add_argument(
        "--engine", action="append", default=[], metavar="tcp://HOST:PORT",
        help="serve a replica started by 'shardserve engine' instead of starting one "
        "(repeat for several replicas); the tokenizer still comes from --model",
    )  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--served-model-name", help="model name in the API (default: dir name)")
    serve.add_argument(
        "--batch-window-ms",
        type=_non_negative_float,
        default=2.0,
        help="how long the frontend gathers requests into one batch",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV})",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=_positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get a 413 (default: 8 MiB)",
    )
    _add_resilience_flags(serve)
    from server.engine_command import add_engine_parser

    add_engine_parser(commands, add_replica_flags)
    return parser


def _add_resilience_flags(serve: argparse.ArgumentParser) -> None:
    """Recovery, load shedding, timeouts and draining (``serve`` only)."""
    group = serve.add_argument_group("resilience")
    group.add_argument(
        "--max-restarts", type=_non_negative_int, default=3, metavar="N",
        help="restart a replica whose rank died at most N times in a row (default 3)",
    )  # fmt: skip
    group.add_argument(
        "--max-queued-requests", type=_positive_int, default=None, metavar="N",
        help="refuse new requests with 429 while N are outstanding (default: no limit)",
    )  # fmt: skip
    group.add_argument(
        "--max-queued-tokens", type=_positive_int, default=None, metavar="T",
        help="refuse new requests with 429 while their prompt + max_tokens would take the "
        "outstanding tokens past T (default: no limit)",
    )  # fmt: skip
    group.add_argument(
        "--request-timeout", type=_positive_float, default=None, metavar="SECONDS",
        help="end a request after SECONDS with a 504 (or an SSE error event) and abort it",
    )  # fmt: skip
    group.add_argument(
        "--shutdown-timeout", type=_non_negative_float, default=30.0, metavar="SECONDS",
        help="on SIGTERM, let requests in flight finish for up to SECONDS (default 30)",
    )  # fmt: skip


def _int_at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    return _int_at_least(0, text)


def _positive_int(text: str) -> int:
    return _int_at_least(1, text)


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
