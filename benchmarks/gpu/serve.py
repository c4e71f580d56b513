"""Our server in ``make gpu-check``: its command line, start-up timings, load points.

Start-up timings are seconds after launch. ``ready_s``: ``GET /health`` first answered
200 (polled every :data:`POLL_S`). The log's marker lines give the rest, timed by
their own ``asctime`` stamp (``2026-12-01 16:22:29,981 ...``) against the launch's
wall clock, since a rank's lines may reach the log file late; a line with no stamp
falls back to the moment it was first seen while polling:

- ``loaded stage 0/1 tp 0/1 on cuda (cuda backend, bfloat16): 15296.0 MiB read; ...``
  → ``weights_read_s``, ``mib_read``, ``loaded_on`` (the part after ``on``, if any);
- ``captured 35 CUDA graphs (...) in 14.2 s`` → ``graph_count``, ``graph_capture_s``
  (the server's own figure), ``graphs_logged_s``;
- ``CUDA graphs disabled (enforce_eager): ...`` → ``graphs_disabled`` (that line).

A load point is one closed-loop run of ``deploy/loadtest.py`` (via
:func:`benchmarks.harness.http_load.run_point`, streamed completions, ``ignore_eos``,
temperature 0), summarised by :func:`summarize_point`.
"""

from __future__ import annotations

import contextlib
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gpu.procs import Proc
from benchmarks.harness.servers import serve_argv

POLL_S = 0.2
LOADED = re.compile(
    r"loaded stage \d+/\d+ tp \d+/\d+(?: on (?P<on>[^:\n]*))?: (?P<mib>\d+(?:\.\d+)?) MiB read"
)
CAPTURED = re.compile(r"captured (?P<count>\d+) CUDA graphs\b.*?\bin (?P<secs>\d+(?:\.\d+)?) ?s\b")
DISABLED = re.compile(r"CUDA graphs disabled[^\n]*")
STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def serve_command(
    model_dir: Path, device: str, dtype: str, port: int, max_num_seqs: int, max_model_len: int
) -> list[str]:
    """``shardserve serve`` (as ``python -m server.cli``, so no install is needed)."""
    return serve_argv(
        model_dir,
        device=device,
        dtype=dtype,
        host="127.0.0.1",
        port=port,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )


def _stamp(text: str, at: int, launch_wall: float | None) -> float | None:
    """Seconds from launch to the ``asctime`` opening the line that holds ``text[at]``."""
    if launch_wall is None:
        return None
    line_start = text.rfind("\n", 0, at) + 1
    match = STAMP.match(text, line_start)
    if match is None:
        return None
    stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")  # local time
    return stamp.timestamp() - launch_wall


def scan_log(text: str, launch_wall: float | None = None) -> dict[str, Any]:
    """What the start-up lines say (keys absent when a line or its stamp is absent).

    ``capture_logged_first``: the capture line came before the ``loaded stage`` line, so
    the latter's time includes the capture, not only the weights' read.
    """
    found: dict[str, Any] = {}
    loaded, captured = LOADED.search(text), CAPTURED.search(text)
    if loaded:
        found["mib_read"] = float(loaded.group("mib"))
        if loaded.group("on"):
            found["loaded_on"] = loaded.group("on")
        if (at := _stamp(text, loaded.start(), launch_wall)) is not None:
            found["weights_read_s"] = at
    if captured:
        found["graph_count"] = int(captured.group("count"))
        found["graph_capture_s"] = float(captured.group("secs"))
        if (at := _stamp(text, captured.start(), launch_wall)) is not None:
            found["graphs_logged_s"] = at
    if loaded and captured:
        found["capture_logged_first"] = captured.start() < loaded.start()
    if disabled := DISABLED.search(text):
        found["graphs_disabled"] = disabled.group(0)
    return found


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    return False


class StartupFailed(RuntimeError):
    """The server did not come up; ``startup`` holds the timings seen before that."""

    def __init__(self, startup: dict[str, Any], why: str, proc: Proc) -> None:
        super().__init__(f"{why}; log tail:\n{proc.log_tail(1500)}")
        self.startup = startup
        self.why = why


def wait_ready(proc: Proc, url: str, timeout_s: float) -> dict[str, Any]:
    """Poll ``/health`` and the log until ready; the start-up timings.

    Raises :class:`StartupFailed` (with the log's tail and the timings seen so far)
    when the server exits or is not ready after ``timeout_s``.
    """
    startup: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        now = time.monotonic() - proc.started
        text = proc.log.read_text(errors="replace")
        if "weights_read_s" not in startup and LOADED.search(text):
            startup["weights_read_s"] = now  # until the line's own stamp says better
        startup.update(scan_log(text, proc.started_wall))
        if _healthy(url):
            startup["ready_s"] = time.monotonic() - proc.started
            return startup
        if proc.popen.poll() is not None:
            raise StartupFailed(startup, f"server exited with {proc.popen.returncode}", proc)
        if time.monotonic() > deadline:
            raise StartupFailed(startup, f"not ready in {timeout_s:.0f} s", proc)
        time.sleep(POLL_S)


def summarize_point(
    metrics: dict[str, Any], concurrency: int, prompt_len: int, output_len: int
) -> dict[str, Any]:
    """The numbers the report uses from one point's load-test metrics."""
    tpot = metrics["tpot_ms"]["p50"]
    prompts, outputs = metrics["prompt_tokens_seen"], metrics["output_tokens_seen"]
    return {
        "concurrency": concurrency,
        "completed": metrics["completed"],
        "sent": metrics["sent"],
        "errors": metrics["errors"],
        "error_samples": metrics.get("error_samples", []),
        "duration_s": metrics["duration_s"],
        "output_tok_s": metrics["streamed_throughput"],
        "decode_tok_s": 1000.0 / tpot if tpot else None,  # per sequence, from median TPOT
        "ttft_ms_p50": metrics["ttft_ms"]["p50"],
        "tpot_ms_p50": tpot,
        "prompt_tokens_seen": prompts,
        "output_tokens_seen": outputs,
        "exact_lengths": prompts == [prompt_len] and outputs == [output_len],
    }
