"""Structured outputs' cost: output tok/s of 32 concurrent json_schema requests against 32
unconstrained ones, on the bench model (float32), one server, in one run.

Both kinds are streaming completions of the same shape (32-token prompts, 64 greedy
output tokens, EOS ignored), on fresh prompts each point. The constrained ones carry
``structured_outputs: {"json": SCHEMA}``, a schema asking for at least 64 short strings,
so that every one of the 64 tokens is sampled under a grammar mask (the answer can
never be complete sooner). The schema is compiled by a warm-up request before anything
is timed (compiling is once per schema; its time is a note), and one untimed point of
full batches runs first (the first one on a fresh server is slower). The two kinds alternate,
the order reversed every other round; the table shows each kind's median round.
Target: constrained ≥ 85% of unconstrained.

``python -m benchmarks suites structured --concurrency 8 --rounds 1`` runs these rows alone
(reduced scale), written to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from benchmarks.harness.bench import (
    OUTPUT_LEN,
    POINT_CAP_S,
    PROMPT_LEN,
    REQUEST_TIMEOUT_S,
    Bench,
    num_requests,
    start_ours,
)
from benchmarks.harness.machine import machine
from benchmarks.harness.paths import CACHE
from benchmarks.harness.prompts import exact_prompts, write_dataset
from benchmarks.harness.tables import ratio, tok_cell
from deploy.loadtest import run_benchmark
from deploy.loadtest_lib.config import LoadPoint, RunConfig

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}
    },
    "required": ["notes"],
}
LAYOUTS = {"free": "unconstrained (same server)", "json": "json_schema"}
DEFAULT_ROUNDS = 2


def _point(bench: Bench, url: str, key: str, c: int, kind: str, record: bool = True) -> None:
    """One closed-loop point of ``kind`` on ``bench``'s dataset ``key`` (recorded unless
    ``record`` is false: a warm-up)."""
    extra: dict[str, Any] = {"temperature": 0}
    if kind == "json":
        extra["structured_outputs"] = {"json": SCHEMA}
    config = RunConfig(
        base_url=url,
        model="",
        endpoint="completions",
        points=(LoadPoint(c, None),),
        output_len=OUTPUT_LEN,
        dataset=bench.datasets[key],
        num_requests=num_requests(c),
        duration_s=POINT_CAP_S,
        timeout_s=REQUEST_TIMEOUT_S,
        ignore_eos=True,
        extra_body=extra,
    )
    load_before = os.getloadavg()[0]
    (point,) = asyncio.run(run_benchmark(config)).points
    metrics: dict[str, Any] = point.metrics.to_json()
    streamed = sum(r.output_tokens if r.ok else r.chunks for r in point.requests)
    metrics["streamed_throughput"] = streamed / metrics["duration_s"]
    metrics["error_samples"] = sorted({str(r.error) for r in point.requests if not r.ok})[:3]
    tok_s = metrics["streamed_throughput"]
    if record:
        bench.add("shardserve", "float32", c, LAYOUTS[kind], tok_s, metrics, load_before)


def _compile_once(url: str) -> float:
    """Seconds the first request with :data:`SCHEMA` takes (the compile included)."""
    body = {
        "prompt": "warm up",
        "max_tokens": 4,
        "temperature": 0,
        "structured_outputs": {"json": SCHEMA},
    }
    started = time.monotonic()
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return time.monotonic() - started


def _datasets(bench: Bench, c: int, count: int) -> list[str]:
    """``count`` datasets of fresh prompts (none another point of the run uses), in
    ``bench.datasets``; their keys."""
    tokenizer = Tokenizer.from_file(str(bench.model / "tokenizer.json"))
    n = num_requests(c)
    prompts = exact_prompts(tokenizer, n * count, PROMPT_LEN, seed="structured-v1")
    keys = [f"structured-c{c}-{i}" for i in range(count)]
    for i, key in enumerate(keys):
        path = CACHE / f"data/{key}.jsonl"
        bench.datasets[key] = str(
            write_dataset(tokenizer, prompts[i * n : (i + 1) * n], OUTPUT_LEN, path)
        )
    return keys


def run_structured(bench: Bench, c: int, rounds: int = DEFAULT_ROUNDS) -> None:
    """The rows of the module docstring at concurrency ``c`` (the server stopped on exit)."""
    keys = _datasets(bench, c, 2 * rounds + 1)
    with contextlib.ExitStack() as stack:
        _, url, _ = start_ours(stack, "float32", [], "structured")
        bench.http_point(("shardserve", url, ""), "float32", None, "")
        compile_s = _compile_once(url)
        bench.notes.append(f"structured outputs: first json_schema request {compile_s:.1f} s")
        _point(bench, url, keys[-1], c, "free", record=False)  # the first full batch is slow
        for r in range(rounds):
            kinds = ("free", "json") if r % 2 == 0 else ("json", "free")
            for i, kind in enumerate(kinds):
                _point(bench, url, keys[2 * r + i], c, kind)


def structured_table(result: dict[str, Any]) -> str:
    """Constrained against unconstrained tok/s, and their ratio (target ≥ 0.85×)."""
    rows = {r["layout"]: r for r in result["rows"] if r["layout"] in LAYOUTS.values()}
    free, constrained = rows.get(LAYOUTS["free"]), rows.get(LAYOUTS["json"])
    if free is None or constrained is None:
        return "(not measured)"
    vs_free = ratio(float(constrained["output_throughput"]), float(free["output_throughput"]))
    return "\n".join(
        [
            "| requests (float32, shardserve) | conc. | output tok/s | vs unconstrained |",
            "|---|---:|---:|---:|",
            f"| unconstrained | {free['concurrency']} | {tok_cell(free)} | |",
            f"| json_schema | {constrained['concurrency']} | {tok_cell(constrained)} | {vs_free} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """These rows alone (reduced scale: ``--concurrency``, ``--rounds``), to ``--out``."""
    parser = argparse.ArgumentParser(description="the structured-output rows of make bench")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--out", default="/tmp/structured-bench.json")
    args = parser.parse_args(argv)
    bench = Bench([args.concurrency])
    run_structured(bench, args.concurrency, args.rounds)
    result = {"machine": machine(), "rows": bench.rows, "notes": bench.notes}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(structured_table(result))
    print("\n".join(f"- {n}" for n in bench.notes))
    return 0
