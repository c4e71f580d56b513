"""The engine token: the shared secret rank 0 checks on every connection's ``Hello``.

``shardserve serve`` draws a fresh one per run for the replicas it spawns and hands it to
their ranks in the environment (:func:`export_engine_token`; never on a command line).
``shardserve engine``, ``serve --engine`` and ``ping`` take it from ``--engine-token`` or
``$SHARDSERVE_ENGINE_TOKEN`` (:func:`add_engine_token_flag`), the same on both sides;
:func:`check_engine_token` refuses a missing or weak one (a ``ValueError`` naming the flag).
"""

from __future__ import annotations

import os
import secrets
from typing import Any

from model_shards.messages import ENGINE_TOKEN_ENV

MIN_TOKEN_CHARS = 16


def add_engine_token_flag(command: Any) -> None:
    """``--engine-token`` (default: ``$SHARDSERVE_ENGINE_TOKEN``) on a parser or group."""
    command.add_argument(
        "--engine-token",
        default=os.environ.get(ENGINE_TOKEN_ENV) or None,
        metavar="SECRET",
        help=f"the engine port's shared secret, the same on the engine and its frontends "
        f"(default: ${ENGINE_TOKEN_ENV}, which keeps it off the process list; at least "
        f"{MIN_TOKEN_CHARS} characters, e.g. `openssl rand -hex 32`)",
    )


def check_engine_token(token: str | None, why: str) -> str:
    """``token`` when it can be an engine token, else ``ValueError`` naming the flag and the
    variable; ``why``: what needs it (ends the message)."""
    if not token:
        raise ValueError(f"--engine-token (or ${ENGINE_TOKEN_ENV}) is required {why}")
    if len(token) < MIN_TOKEN_CHARS or not token.isprintable():
        raise ValueError(
            f"--engine-token (or ${ENGINE_TOKEN_ENV}) must be at least {MIN_TOKEN_CHARS} "
            f"printable characters (e.g. `openssl rand -hex 32`), got {len(token)}"
        )
    return token


def new_engine_token() -> str:
    """A fresh random token (256 bits) for one run's spawned replicas."""
    return secrets.token_hex(32)


def export_engine_token(token: str) -> None:
    """Put ``token`` in this process's environment, which every rank it spawns (or respawns
    after a failure) inherits and rank 0 reads (never a command line: ``ps`` shows those)."""
    os.environ[ENGINE_TOKEN_ENV] = token
