"""Load generator for any OpenAI-compatible server (shardserve, vLLM, TGI, transformers serve).

Synopsis::

    python deploy/loadtest.py --base-url http://127.0.0.1:8000 [--api-key KEY] [--model M]
        [--endpoint completions|chat]
        [--concurrency N | --sweep-concurrency 1,8,32]
        [--request-rate R|inf | --sweep-rate 1,2,4] [--burstiness B]
        [--input-len 256 --output-len 128 | --dataset prompts.jsonl] [--seed 0]
        [--num-requests 100] [--duration S] [--timeout 600]
        [--slo ttft:MS,tpot:MS,e2e:MS] [--no-ignore-eos] [--extra-body JSON]
        [--out result.json] [--plot DIR] [--no-progress]
    python deploy/loadtest.py --compare a.json b.json [--plot DIR]

Each load point sends streamed requests (SSE, usage included) and measures request and
output-token throughput, goodput against ``--slo``, and TTFT, TPOT, ITL and end-to-end
latency (mean/p50/p90/p99). Failed requests are counted by kind and never retried. A
point stops after ``--num-requests`` or at the ``--duration`` deadline, cancelling what
is still in flight. Rate and concurrency combine: ``--request-rate 4 --concurrency 8``
paces arrivals and caps requests in flight. Without either, the load is one request at
a time; ``--request-rate inf`` sends everything at once.

Exit status: 0 when the run finished and at least one request succeeded, 1 when none did
or the server could not be reached, 2 for bad arguments. The result file's schema is in
``deploy/loadtest_lib/results.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the ``deploy`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deploy.loadtest_lib.client import (
    Target,
    count_tokens,
    discover_model,
    make_client,
    normalize_base_url,
    spec_decode_totals,
)
from deploy.loadtest_lib.config import (
    ENDPOINTS,
    LoadPoint,
    RunConfig,
    parse_number_list,
    parse_slo,
)
from deploy.loadtest_lib.metrics import compute_metrics, with_spec_decode
from deploy.loadtest_lib.progress import ProgressBar
from deploy.loadtest_lib.report import format_comparison, format_summary
from deploy.loadtest_lib.results import (
    PointResult,
    RunResult,
    load_result,
    save_result,
)
from deploy.loadtest_lib.runner import Bounds, run_point
from deploy.loadtest_lib.workload import (
    PromptSource,
    RequestSpec,
    load_dataset,
    synthetic_requests,
)

DEFAULT_NUM_REQUESTS = 100
DURATION_ONLY_POOL = 1000
"""Distinct synthetic prompts when only ``--duration`` bounds the run (then reused)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadtest", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    server = p.add_argument_group("server")
    server.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    server.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'; never saved")
    server.add_argument("--model", help="default: the first id of GET /v1/models")
    server.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    load = p.add_argument_group("load shape")
    load.add_argument("--concurrency", type=int, help="max requests in flight")
    load.add_argument("--request-rate", help="mean arrivals per second, or 'inf'")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    load.add_argument("--sweep-concurrency", help="one point per value, e.g. 1,8,32")
    load.add_argument("--sweep-rate", help="one point per value, e.g. 1,2,4")
    work = p.add_argument_group("workload")
    work.add_argument("--input-len", type=int, default=256, help="prompt tokens (synthetic)")
    work.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    work.add_argument("--dataset", help='JSONL: {"prompt": str, "output_len": int (optional)}')
    work.add_argument("--seed", type=int, default=0, help="fixes prompts and arrival times")
    work.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (for servers that reject it)",
    )
    work.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    bounds = p.add_argument_group("bounds (per load point)")
    bounds.add_argument(
        "--num-requests",
        type=int,
        help=f"requests to send (default {DEFAULT_NUM_REQUESTS} without --duration)",
    )
    bounds.add_argument("--duration", type=float, help="seconds; in-flight requests are cancelled")
    bounds.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    out = p.add_argument_group("output")
    out.add_argument("--slo", help="goodput objectives in ms, e.g. ttft:500,tpot:50")
    out.add_argument("--out", help="write the result JSON here")
    out.add_argument("--plot", help="write PNG charts into this directory")
    out.add_argument("--no-progress", dest="progress", action="store_false")
    out.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="print two result files side by side (with --plot: chart them)",
    )
    return p


def _rate(text: str | None) -> float | None:
    if text is None or text.strip().lower() in ("inf", "infinity"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--request-rate: expected a number or 'inf', got {text!r}") from None


def load_points(args: argparse.Namespace) -> tuple[LoadPoint, ...]:
    """The load points the flags ask for; ``ValueError`` for contradicting flags."""
    if args.sweep_concurrency and args.sweep_rate:
        raise ValueError("--sweep-concurrency and --sweep-rate: choose one")
    if args.sweep_concurrency and args.concurrency is not None:
        raise ValueError("--sweep-concurrency replaces --concurrency: drop one")
    if args.sweep_rate and args.request_rate is not None:
        raise ValueError("--sweep-rate replaces --request-rate: drop one")
    rate, b = _rate(args.request_rate), args.burstiness
    if args.sweep_concurrency:
        values = parse_number_list(args.sweep_concurrency, "--sweep-concurrency", int)
        return tuple(LoadPoint(c, rate, b) for c in values)
    if args.sweep_rate:
        values = parse_number_list(args.sweep_rate, "--sweep-rate", float)
        return tuple(LoadPoint(args.concurrency, r, b) for r in values)
    if args.concurrency is None and args.request_rate is None:
        return (LoadPoint(1, None, b),)
    return (LoadPoint(args.concurrency, rate, b),)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """A validated :class:`RunConfig` (``model`` may be empty: discovered at run time)."""
    if not args.base_url:
        raise ValueError("--base-url is required (e.g. --base-url http://127.0.0.1:8000)")
    try:
        extra_body = json.loads(args.extra_body)
    except ValueError:
        raise ValueError(f"--extra-body: not JSON: {args.extra_body!r}") from None
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object, e.g. '{\"temperature\": 0}'")
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = DEFAULT_NUM_REQUESTS
    return RunConfig(
        base_url=normalize_base_url(args.base_url),
        model=args.model or "",
        endpoint=args.endpoint,
        points=load_points(args),
        input_len=args.input_len,
        output_len=args.output_len,
        dataset=args.dataset,
        num_requests=num_requests,
        duration_s=args.duration,
        timeout_s=args.timeout,
        seed=args.seed,
        slo=parse_slo(args.slo),
        ignore_eos=args.ignore_eos,
        extra_body=extra_body,
    )


async def run_benchmark(
    config: RunConfig, api_key: str | None = None, progress: bool = False
) -> RunResult:
    """Run every load point of ``config`` in order against one warm client.

    Discovers the model when ``config.model`` is empty and builds the prompts once, so
    every point sends the same requests. ``RuntimeError`` if the server is unreachable.
    """
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    async with make_client(config.base_url, api_key, config.timeout_s) as client:
        if not config.model:
            config = dataclasses.replace(config, model=await discover_model(client))
        specs: list[RequestSpec]
        source: PromptSource
        if config.dataset:
            specs, source = load_dataset(config.dataset, config.output_len), "dataset"
        else:
            model = config.model

            async def count(prompt: str) -> int | None:
                return await count_tokens(client, model, prompt)

            pool = config.num_requests or DURATION_ONLY_POOL
            specs, source = await synthetic_requests(
                pool, config.input_len, config.output_len, config.seed, count
            )
        target = Target(config.model, config.endpoint, config.ignore_eos, config.extra_body)
        bounds = Bounds(config.num_requests, config.duration_s, config.timeout_s)
        points: list[PointResult] = []
        for n, point in enumerate(config.points, start=1):
            bar = None
            if progress:
                label = f"{n}/{len(config.points)} {point.label}"
                bar = ProgressBar(label, config.num_requests, config.duration_s)
            before = await spec_decode_totals(client)
            records, elapsed = await run_point(
                client, target, specs, point, bounds, config.seed, bar
            )
            if bar is not None:
                bar.close()
            metrics = compute_metrics(records, elapsed, config.slo)
            metrics = with_spec_decode(metrics, before, await spec_decode_totals(client))
            points.append(PointResult(point, metrics, tuple(records)))
    return RunResult(config, started_at, source, tuple(points))


def _compare(args: argparse.Namespace) -> int:
    path_a, path_b = args.compare
    a, b = load_result(path_a), load_result(path_b)
    print(format_comparison(a, b, path_a, path_b))
    if args.plot:
        from deploy.loadtest_lib.plots import plot_runs

        plot_runs([(Path(path_a).stem, a), (Path(path_b).stem, b)], args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point (``shardserve bench`` and ``python deploy/loadtest.py``); see module doc."""
    args = build_parser().parse_args(argv)
    try:
        if args.compare:
            return _compare(args)
        config = config_from_args(args)
        if args.dataset:
            load_dataset(args.dataset, args.output_len)  # fail on a bad file before any request
        result = asyncio.run(run_benchmark(config, args.api_key, args.progress))
        print(format_summary(result))
        if args.out:
            save_result(result, args.out)
        if args.plot:
            from deploy.loadtest_lib.plots import plot_runs

            plot_runs([(Path(args.out).stem if args.out else "run", result)], args.plot)
    except (ValueError, OSError) as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 1
    return 0 if any(p.metrics.completed for p in result.points) else 1


if __name__ == "__main__":
    sys.exit(main())
