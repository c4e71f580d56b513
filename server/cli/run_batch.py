"""``shardserve run-batch -i IN -o OUT``: an OpenAI batch file through the model, as vLLM's.

Order, as ``serve``'s, so a mistake costs nothing: read the input (every line parsed,
:mod:`server.api.batch`; a ``custom_id`` given twice exits 2 naming ``--input-file``) and the
output (lines whose ``custom_id`` has a record there already are skipped: a stopped run
resumes), then the flags, tokenizer and chat template (:func:`server.cli.startup.
check_start_up`); a mistake exits 2 naming the flag, nothing spawned. Then the replicas start
as ``serve`` starts them (or ``--engine`` ones are used), the app is built in this process
from the same flags and driven through ``httpx.ASGITransport`` (no socket): at most
``--max-concurrency`` lines in flight, each record appended to the output and flushed as it
completes, a progress bar on stderr (tqdm when installed, else a counter). A bad line gets
its own error record and the rest go on. Exit 0 once every line has a record, 1 if the
engine dies or is not ready in time; SIGINT/SIGTERM stop it (the ranks too), exit 128 + signal.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import httpx

from server.api.batch import Job, done_custom_ids, parse_line, run_job
from server.cli.signals import ServeState, SignalGuard, Stop
from server.cli.startup import (
    READY_TIMEOUT_S,
    ReplicaHandle,
    app_from_flags,
    check_start_up,
    error,
    replica_clients,
    start_own_replicas,
)
from server.text.tokenizer import Tokenizer

logger = logging.getLogger("shardserve")


def read_jobs(path: str) -> list[Job]:
    """Every non-blank line of the input file as a job; ``ValueError`` naming the flag if the
    file cannot be read or a ``custom_id`` comes twice."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--input-file {path}: cannot read it ({exc})") from exc
    jobs = [parse_line(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    seen: dict[str, int] = {}
    for job in jobs:
        if job.custom_id is not None and job.custom_id in seen:
            raise ValueError(
                f"--input-file {path}: custom_id {job.custom_id!r} is on lines "
                f"{seen[job.custom_id]} and {job.number}; each must be unique"
            )
        if job.custom_id is not None:
            seen[job.custom_id] = job.number
    return jobs


def prepare_output(path: str) -> set[str]:
    """The ``custom_id`` of the records the output holds already (none for a new file); a
    record cut short by a crash is removed. ``ValueError`` naming the flag if it cannot be
    written."""
    out = Path(path)
    if out.is_dir() or not out.parent.is_dir():
        raise ValueError(f"--output-file {path}: not a file in an existing directory")
    try:
        if not out.exists():
            out.touch()
            return set()
        data = out.read_bytes()
        if data and not data.endswith(b"\n"):  # the last write was cut short: drop it
            with out.open("r+b") as file:
                file.truncate(data.rfind(b"\n") + 1)
            data = data[: data.rfind(b"\n") + 1]
    except OSError as exc:
        raise ValueError(f"--output-file {path}: cannot write it ({exc})") from exc
    return done_custom_ids(data.decode("utf-8", errors="replace").splitlines())


def run_batch(args: argparse.Namespace) -> int:
    """Run the ``run-batch`` command; see the module docstring."""
    try:
        jobs = read_jobs(args.input_file)
        done = prepare_output(args.output_file)
        config, tokenizer, name = check_start_up(args)
    except ValueError as exc:
        error(str(exc))
        return 2
    todo = [job for job in jobs if job.custom_id is None or job.custom_id not in done]
    logger.info(
        "%d of %d lines to run (%d done before)", len(todo), len(jobs), len(jobs) - len(todo)
    )
    if not todo:
        return 0
    handles: Sequence[ReplicaHandle] = ()
    guard = SignalGuard(ServeState())
    try:
        try:
            handles = start_own_replicas(args, config, guard)
        except ValueError as exc:
            error(str(exc))
            return 2
        return asyncio.run(_run(args, handles, tokenizer, name, todo))
    except Stop as stop:
        error(f"interrupted by {stop}; {args.output_file} holds the lines done (run it again)")
        return 128 + stop.signum
    finally:
        guard.ignore()
        try:
            for started in handles:
                started.stop()
        finally:
            guard.restore()


async def _run(
    args: argparse.Namespace,
    handles: Sequence[ReplicaHandle],
    tokenizer: Tokenizer,
    name: str,
    jobs: list[Job],
) -> int:
    """Connect to the replicas, then run ``jobs`` on the app in this process."""
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
            error(str(exc))
            return 1
        app = app_from_flags(args, router, tokenizer, name, ready.max_model_len, metrics)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 record
        async with httpx.AsyncClient(
            transport=transport, base_url="http://run-batch", headers=headers, timeout=None
        ) as http:
            with open(args.output_file, "a", encoding="utf-8") as out:
                await _run_jobs(http, jobs, out, args.max_concurrency)
        return 0
    finally:
        await router.close(send_shutdown=bool(handles))


async def _run_jobs(
    http: httpx.AsyncClient, jobs: list[Job], out: TextIO, concurrency: int
) -> None:
    """``concurrency`` workers take the jobs in order; each record is written as it comes."""
    pending: Iterator[Job] = iter(jobs)
    progress = _progress(len(jobs))

    async def worker() -> None:
        for job in pending:  # shared: each job goes to one worker
            record = await run_job(http, job)
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            progress.update(1)

    try:
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))
    finally:
        progress.close()


class _Counter:
    """A progress line on stderr when tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def update(self, n: int) -> None:
        self.done += n
        print(f"\rrun-batch: {self.done}/{self.total} lines", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr, flush=True)


def _progress(total: int) -> Any:
    """A tqdm bar on stderr (tqdm is optional), else a :class:`_Counter`."""
    if importlib.util.find_spec("tqdm") is None:
        return _Counter(total)
    from tqdm import tqdm

    return tqdm(total=total, desc="run-batch", unit="line", file=sys.stderr)
