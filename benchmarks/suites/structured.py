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

import asyncio
import contextlib
import os
import time
from typing import Any

import httpx
from tokenizers import Tokenizer

from benchmarks.harness.ab_rows import Point, alternate, pair_table, run_alone
from benchmarks.harness.bench import (
    OUTPUT_LEN,
    POINT_CAP_S,
    PROMPT_LEN,
    REQUEST_TIMEOUT_S,
    Bench,
    num_requests,
    start_ours,
)
from benchmarks.harness.paths import CACHE
from benchmarks.harness.prompts import exact_prompts, write_dataset
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
KINDS = ("free", "json")
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
        point: Point = lambda d, kind, rec: _point(bench, url, d, c, kind, rec)  # noqa: E731
        alternate(point, keys, KINDS, rounds, warm="free")


def structured_table(result: dict[str, Any]) -> str:
    """Constrained against unconstrained tok/s, and their ratio (target ≥ 0.85×)."""
    layouts = (LAYOUTS["free"], LAYOUTS["json"])
    return pair_table(result, layouts, ("unconstrained", "json_schema"), "vs unconstrained")


def main(argv: list[str] | None = None) -> int:
    """These rows alone (reduced scale: ``--concurrency``, ``--rounds``), to ``--out``."""
    description = "the structured-output rows of make bench"
    out = "/tmp/structured-bench.json"
    return run_alone(description, out, DEFAULT_ROUNDS, run_structured, structured_table, argv)
