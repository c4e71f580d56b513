"""One closed-loop load point against an HTTP server, through ``deploy/loadtest.py``.

Streams ``num_requests`` requests from a JSONL dataset (exact-length text prompts,
see :mod:`benchmarks.harness.prompts`) at a fixed concurrency, greedy, and returns the
point's metrics as a plain dict. ``transformers serve`` refuses ``ignore_eos`` (422
on unknown fields), so for it the fixed output length comes from a request
``generation_config`` with EOS disabled instead.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from deploy.loadtest import run_benchmark
from deploy.loadtest_lib.config import LoadPoint, RunConfig


def hf_serve_body(output_len: int) -> dict[str, Any]:
    config = {"max_new_tokens": output_len, "do_sample": False, "eos_token_id": -1}
    return {"temperature": 0, "generation_config": json.dumps(config)}


def run_point(
    base_url: str,
    model: str,
    dataset: str,
    concurrency: int,
    num_requests: int,
    output_len: int,
    *,
    hf_serve: bool,
    duration_s: float,
    timeout_s: float,
    extra_body: dict[str, Any] | None = None,
    ignore_eos: bool | None = None,
) -> dict[str, Any]:
    """Metrics of one point (``deploy.loadtest_lib.metrics.PointMetrics`` as JSON).

    ``extra_body``: fields merged last into every request (a server's own names for them).
    ``ignore_eos``: every request runs ``output_len`` tokens (default: unless ``hf_serve``);
    ``False``: a request ends at its end of turn (``output_len`` at most).

    ``duration_s`` caps the point: requests still running then are cancelled and
    counted in ``errors``, so a slow system cannot stall the whole benchmark.
    """
    config = RunConfig(
        base_url=base_url,
        model=model,
        endpoint="completions",
        points=(LoadPoint(concurrency, None),),
        output_len=output_len,
        dataset=dataset,
        num_requests=num_requests,
        duration_s=duration_s,
        timeout_s=timeout_s,
        ignore_eos=not hf_serve if ignore_eos is None else ignore_eos,
        extra_body={
            **(hf_serve_body(output_len) if hf_serve else {"temperature": 0}),
            **(extra_body or {}),
        },
    )
    result = asyncio.run(run_benchmark(config))
    (point,) = result.points
    metrics: dict[str, Any] = point.metrics.to_json()
    metrics["prompt_tokens_seen"] = sorted({r.prompt_tokens for r in point.requests if r.ok})
    metrics["output_tokens_seen"] = sorted({r.output_tokens for r in point.requests if r.ok})
    # Tokens streamed by requests cut short by the cap count too (one text chunk ≈ one
    # token), so a capped point still reports its real rate.
    streamed = sum(r.output_tokens if r.ok else r.chunks for r in point.requests)
    metrics["streamed_throughput"] = streamed / metrics["duration_s"]
    metrics["error_samples"] = sorted({str(r.error) for r in point.requests if not r.ok})[:3]
    return metrics
