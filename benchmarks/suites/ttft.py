"""Time to first token at concurrency 1, and where it goes, measured on the real path.

Starts ``shardserve serve`` with ``SHARDSERVE_TTFT_TRACE`` set (:mod:`server.http.ttft_trace`:
the frontend and rank 0 stamp ``time.monotonic_ns()`` at each stage of a request), sends
streamed completions one at a time (fresh 32-token prompts, so no prefix-cache hits,
greedy, ``OUTPUT_LEN`` tokens) and stamps the client side too: the send and the first
``data:`` line. ``CLOCK_MONOTONIC`` is one clock for the host, so consecutive stamps of
one request give the duration of each stage, and the stages sum to the client's TTFT.
Each stage's row is its median over the requests (medians do not add up exactly).

Tracing is a measuring instrument that costs time itself: rank 0 hooks the modules of every
layer of a traced step (:mod:`model_shards.worker.layer_timer`), Python around each of them. So
the headline TTFT comes from a second server of the same dtype with tracing off, as many
requests (fresh prompts) measured at the client only; the traced requests' own median is
the row the stages sum to.

``make bench`` runs :func:`run_ttft` (float32 and bfloat16) and
:func:`ttft_table` renders the breakdown; alone::

    python -m benchmarks suites ttft --dtypes float32 --requests 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from benchmarks.harness import servers
from benchmarks.harness.bench import Bench
from benchmarks.harness.model import ensure_model
from benchmarks.harness.paths import CACHE
from benchmarks.harness.prompts import exact_prompts

PROMPT_LEN, OUTPUT_LEN = 32, 4
REQUESTS, WARMUP = 20, 3
LAYOUT = "ttft breakdown"
TRACE_ENV = "SHARDSERVE_TTFT_TRACE"  # server.http.ttft_trace.TRACE_ENV (no server import here)

#: The stamps in path order (``side:stage``) and the label of the stage ending at each.
POINTS: tuple[tuple[str, str], ...] = (
    ("client:sent", ""),
    ("frontend:http_received", "connect + HTTP parse (uvicorn)"),
    ("frontend:body_read", "request body read"),
    ("frontend:validated", "validation (pydantic)"),
    ("frontend:tokenize_start", "route checks"),
    ("frontend:tokenized", "tokenization"),
    ("frontend:submitted", "choices plan"),
    ("frontend:batch_sent", "frontend batch window"),
    ("engine:received", "ZMQ hop to rank 0"),
    ("engine:admitted", "admission checks"),
    ("engine:scheduled", "wait for a step + scheduling"),
    ("engine:plan_sent", "plan broadcast"),
    ("engine:forward_done", "prefill compute (all layers)"),
    ("engine:lm_head_done", "LM head"),
    ("engine:sampled", "sampling"),
    ("engine:outputs_built", "scheduler update"),
    ("frontend:frontend_received", "ZMQ hop to the frontend"),
    ("frontend:detokenized", "detokenization"),
    ("frontend:first_frame", "SSE chunk built"),
    ("frontend:first_flush", "first SSE flush"),
    ("client:first_byte", "socket to the client"),
)

#: ``model_shards.worker.layer_timer`` kinds (engine stamps ``layer:<kind>``, durations in ns),
#: shown under "prefill compute (all layers)"; the blocks include their GEMMs and kernel.
LAYER_KINDS = (
    "embedding",
    "norms",
    "attention block",
    "attention GEMM",
    "attention kernel",
    "MLP block",
    "MLP GEMM",
)
LAYER_PREFIX = "layer:"


def labels_in_order() -> list[str]:
    """Every row label: the stages in path order, the layer kinds after the prefill row."""
    out: list[str] = []
    for key, label in POINTS:
        if label:
            out.append(label)
        if key == "engine:forward_done":
            out.extend(f"↳ {kind}" for kind in LAYER_KINDS)
    return out


def stage_ms(client: dict[str, int], record: dict[str, Any]) -> dict[str, float]:
    """Each stage's duration (ms) for one request: the gap between consecutive stamps that
    are present (a stage whose end stamp is missing is merged into the next one)."""
    stamps = {f"client:{k}": v for k, v in client.items()}
    for side in ("frontend", "engine"):
        stamps.update({f"{side}:{k}": int(v) for k, v in record.get(side, {}).items()})
    out: dict[str, float] = {}
    previous: int | None = None
    for key, label in POINTS:
        if key not in stamps:
            continue
        if previous is not None:
            out[label] = (stamps[key] - previous) / 1e6
        previous = stamps[key]
    engine = record.get("engine", {})
    for kind in LAYER_KINDS:
        if LAYER_PREFIX + kind in engine:
            out[f"↳ {kind}"] = int(engine[LAYER_PREFIX + kind]) / 1e6
    return out


def summarize(
    samples: list[dict[str, float]], traced_ms: list[float], untraced_ms: list[float]
) -> dict[str, Any]:
    """Median per stage (in path order), of the traced requests' TTFT, and of the untraced
    ones' (``ttft_ms``: the headline)."""
    labels = [label for label in labels_in_order() if any(label in s for s in samples)]
    stages = {label: statistics.median(s[label] for s in samples if label in s) for label in labels}
    return {
        "requests": len(untraced_ms),
        "ttft_ms": statistics.median(untraced_ms),
        "traced_requests": len(traced_ms),
        "traced_ttft_ms": statistics.median(traced_ms),
        "stages": stages,
    }


def _one_request(
    client: httpx.Client, url: str, prompt: str, output_len: int
) -> tuple[str, dict[str, int]]:
    """Stream one completion; its id and the client's stamps."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    stamps = {"sent": time.monotonic_ns()}
    response_id = ""
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            stamps.setdefault("first_byte", time.monotonic_ns())
            if not response_id and line != "data: [DONE]":
                response_id = str(json.loads(line[5:])["id"])
    return response_id, stamps


def client_stamps(
    url: str, prompts: list[str], warmup: int, output_len: int
) -> dict[str, dict[str, int]]:
    """One request at a time; the client's stamps by response id (the first ``warmup``
    requests not kept)."""
    clients: dict[str, dict[str, int]] = {}
    with httpx.Client(timeout=120) as client:
        for i, prompt in enumerate(prompts):
            rid, stamps = _one_request(client, url, prompt, output_len)
            if i >= warmup:
                clients[rid] = stamps
    return clients


def client_ttft_ms(stamps: dict[str, int]) -> float:
    return (stamps["first_byte"] - stamps["sent"]) / 1e6


def measure(
    url: str, trace_file: Path, prompts: list[str], warmup: int, output_len: int = OUTPUT_LEN
) -> tuple[list[dict[str, float]], list[float]]:
    """Traced requests one at a time: each one's stages and client TTFT."""
    clients = client_stamps(url, prompts, warmup, output_len)
    time.sleep(0.2)  # the trace of the last request is written as its first byte leaves
    samples, ttft_ms = [], []
    for line in trace_file.read_text().splitlines():
        record = json.loads(line)
        ids = record.get("request_ids") or []
        if ids and ids[0] in clients:
            stamps = clients.pop(ids[0])
            samples.append(stage_ms(stamps, record))
            ttft_ms.append(client_ttft_ms(stamps))
    if clients:
        raise RuntimeError(f"no server trace for {len(clients)} requests (is tracing on?)")
    return samples, ttft_ms


def text_prompts(model: Path, count: int, seed: str) -> list[str]:
    """``count`` distinct ``PROMPT_LEN``-token prompts as text."""
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = exact_prompts(tokenizer, count, PROMPT_LEN, seed=seed)
    return [tokenizer.decode(p, skip_special_tokens=True) for p in ids]


def run_dtype(
    dtype: str,
    requests: int,
    warmup: int,
    flags: list[str],
    log: Path,
    output_len: int = OUTPUT_LEN,
) -> dict[str, Any]:
    """A server in ``dtype`` with tracing on (the stages), then one with tracing off (the
    headline TTFT), each measured and stopped."""
    model = ensure_model("main")
    prompts = text_prompts(model, 2 * (requests + warmup), seed=f"ttft-{dtype}")
    traced_prompts, untraced_prompts = prompts[: requests + warmup], prompts[requests + warmup :]
    command = servers.ours_command(model, dtype, flags)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ttft-") as tmp:
        trace_file = Path(tmp) / "trace.jsonl"
        with servers.running(command, log, extra_env={TRACE_ENV: str(trace_file)}) as url:
            samples, traced = measure(url, trace_file, traced_prompts, warmup, output_len)
    untraced_log = log.with_name(log.stem + "-untraced" + log.suffix)
    with servers.running(command, untraced_log) as url:
        clients = client_stamps(url, untraced_prompts, warmup, output_len)
    result = summarize(samples, traced, [client_ttft_ms(s) for s in clients.values()])
    result["loadavg_before"] = load_before
    return result


def run_ttft(bench: Bench, dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> None:
    """The breakdown rows of ``make bench`` (one server per dtype, stopped on exit)."""
    for dtype in dtypes:
        log = CACHE / "logs" / f"shardserve-{dtype}-ttft.log"
        m = run_dtype(dtype, REQUESTS, WARMUP, [], log)
        bench.rows.append(
            {
                "system": "shardserve",
                "dtype": dtype,
                "concurrency": 1,
                "layout": LAYOUT,
                "output_throughput": 0.0,  # not a throughput point
                "ttft": m,
                "loadavg_before": m["loadavg_before"],
            }
        )
        print(f"  ttft {dtype}: {m['ttft_ms']:.1f} ms (median of {m['requests']})", flush=True)


def ttft_table(result: dict[str, Any]) -> str:
    """Median stage durations per dtype, then the client's median TTFT and the load."""
    rows = {r["dtype"]: r["ttft"] for r in result["rows"] if r["layout"] == LAYOUT}
    if not rows:
        return "(not measured)"
    dtypes = sorted(rows, key=lambda d: d != "float32")
    labels = [label for label in labels_in_order() if any(label in rows[d]["stages"] for d in rows)]
    lines = [
        "| stage (concurrency 1, 32-token prompt) | "
        + " | ".join(f"{d} ms" for d in dtypes)
        + " |",
        "|---|" + "---:|" * len(dtypes),
    ]
    for label in labels:
        cells = [rows[d]["stages"].get(label) for d in dtypes]
        lines.append(
            f"| {label} | " + " | ".join("—" if c is None else f"{c:.2f}" for c in cells) + " |"
        )
    if all("traced_ttft_ms" in rows[d] for d in dtypes):
        traced = " | ".join(
            f"{rows[d]['traced_ttft_ms']:.1f} (n={rows[d]['traced_requests']})" for d in dtypes
        )
        lines.append(f"| TTFT at the client, these traced requests (median) | {traced} |")
    ttft = " | ".join(f"**{rows[d]['ttft_ms']:.1f}** (n={rows[d]['requests']})" for d in dtypes)
    lines.append(f"| **TTFT at the client, tracing off (median)** | {ttft} |")
    load = " | ".join(f"{rows[d].get('loadavg_before', 0.0):.1f}" for d in dtypes)
    lines.append(f"| load average before | {load} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="TTFT breakdown at concurrency 1")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    parser.add_argument("--out", help="also write the rows as JSON here")
    parser.add_argument("flags", nargs="*", help="extra `shardserve serve` flags (after --)")
    args = parser.parse_args(argv)
    rows = []
    for dtype in args.dtypes.split(","):
        log = Path(tempfile.gettempdir()) / f"shardserve-ttft-{dtype}.log"
        m = run_dtype(dtype, args.requests, args.warmup, args.flags, log, args.output_len)
        rows.append({"dtype": dtype, "layout": LAYOUT, "ttft": m})
    result = {"rows": rows}
    if args.out:
        with contextlib.suppress(OSError):
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(ttft_table(result))
    return 0
