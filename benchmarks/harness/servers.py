"""Start an HTTP server as a subprocess, wait until it answers, and always stop it.

Each server runs in its own session (process group), so stopping it reaches every
process it spawned (our rank processes included): SIGTERM to the group, then SIGKILL
to whatever is left after a grace period. :func:`running` does this in a ``finally``,
so an exception or Ctrl-C in the benchmark never leaves a server behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks.harness.paths import CACHE, REPO

PYDEPS = CACHE / "pydeps"
"""Benchmark-only packages (``accelerate`` for ``transformers serve``), kept out of .venv."""
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 30.0
SERVING_LINE = re.compile(r"serving \S+ on (http://\S+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_argv(model: Path, **flags: object) -> list[str]:
    """``shardserve serve --model MODEL --flag value …`` as ``python -m server.cli`` (no install
    needed); ``flags`` by their Python names (``max_num_seqs=64`` → ``--max-num-seqs 64``)."""
    argv = [sys.executable, "-m", "server.cli", "serve", "--model", str(model)]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def ours_command(model: Path, dtype: str, extra: list[str]) -> list[str]:
    return [*serve_argv(model, dtype=dtype, device="cpu", port=0, max_num_seqs=64), *extra]


def ours_flags() -> str:
    """``shardserve serve --help``, to see which optional flags this checkout has."""
    done = subprocess.run(
        ours_command(Path("."), "auto", ["--help"]),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def hf_serve_command(model: Path, dtype: str, port: int) -> list[str]:
    cli = Path(sys.executable).with_name("transformers")
    return [
        str(cli),
        "serve",
        "--continuous-batching",
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        str(model),
    ]


def _wait_url(
    proc: subprocess.Popen[bytes], log: Path, fixed_url: str | None, timeout_s: float
) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        url = fixed_url
        if url is None:
            match = SERVING_LINE.search(log.read_text(errors="replace"))
            url = match.group(1) if match else None
        if url is not None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    return url
        time.sleep(0.5)
    raise TimeoutError(f"server not ready in {timeout_s:g} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, then SIGKILL what remains of it."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)  # ranks that outlived their parent, or a hung server
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


_RUNNING: dict[int, str] = {}  # pid -> base URL ("" until up) of the servers `running` has up


def running_pids() -> list[int]:
    """The pids of every server :func:`running` has started and not yet stopped."""
    return sorted(_RUNNING)


def pid_serving(url: str) -> int:
    """The pid of the server :func:`running` yielded ``url`` for (its process family's root)."""
    return next(pid for pid, served in _RUNNING.items() if served == url)


@contextlib.contextmanager
def running(
    command: list[str],
    log: Path,
    url: str | None = None,
    extra_env: dict[str, str] | None = None,
    tree: Path = REPO,
) -> Iterator[str]:
    """Run ``command``; yield its base URL once ``GET /v1/models`` answers 200.

    ``url`` is the known address (else parsed from shardserve's ``serving ... on`` line);
    ``tree``: the checkout whose ``server`` and ``model_shards`` it imports (an A/B of two
    commits runs one server from each).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            command,
            cwd=tree,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    _RUNNING[proc.pid] = ""
    try:
        _RUNNING[proc.pid] = _wait_url(proc, log, url, START_TIMEOUT_S)
        yield _RUNNING[proc.pid]
    finally:
        _RUNNING.pop(proc.pid, None)
        _stop(proc)
