"""PNG charts of one run, or of several runs overlaid (``--compare``).

Uses matplotlib's object API on the Agg canvas: no pyplot state, no display needed.
matplotlib is imported only when plotting, so the rest of the tool works without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.loadtest_lib.records import RequestRecord
from deploy.loadtest_lib.results import PointResult, RunResult

CDF_CHARTS = {
    "ttft_cdf.png": ("TTFT", lambda r: [r.ttft_ms] if r.ttft_ms is not None else []),
    "itl_cdf.png": ("inter-token latency", lambda r: list(r.itl_ms)),
    "e2e_cdf.png": ("end-to-end latency", lambda r: [r.e2e_ms] if r.e2e_ms is not None else []),
}
LOAD_CHARTS = ("throughput_vs_load.png", "p99_ttft_vs_load.png")
CHART_FILES = (*CDF_CHARTS, *LOAD_CHARTS)


def _figure(*, ncols: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5 * ncols, 4.5), layout="constrained")
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _series_name(run_name: str | None, point: PointResult) -> str:
    return point.load.label if run_name is None else f"{run_name}: {point.load.label}"


def _xs(result: RunResult) -> list[float]:
    """Load per point: request rate if paced, else concurrency, else the point number."""
    return [
        value if (value := p.load.load_value) is not None else float(i + 1)
        for i, p in enumerate(result.points)
    ]


def _load_axis(runs: Sequence[tuple[str, RunResult]]) -> str:
    kinds = {
        "request rate (req/s)" if p.load.request_rate is not None else "concurrency"
        for _, run in runs
        for p in run.points
    }
    return kinds.pop() if len(kinds) == 1 else "load (request rate or concurrency)"


def _cdf(ax: Any, values: list[float], label: str) -> None:
    ordered = sorted(values)
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=label)


def plot_runs(runs: Sequence[tuple[str, RunResult]], out_dir: str | Path) -> list[Path]:
    """Write :data:`CHART_FILES` into ``out_dir`` (created if missing); return their paths.

    One run: one series per load point. Several runs: series named ``run: point``.
    Points without successful requests are left out of the latency charts.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    single = len(runs) == 1
    written: list[Path] = []
    for filename, (title, pick) in CDF_CHARTS.items():
        fig, (ax,) = _figure()
        for name, run in runs:
            for point in run.points:
                ok: list[RequestRecord] = [r for r in point.requests if r.ok]
                values = [v for r in ok for v in pick(r)]
                if values:
                    _cdf(ax, values, _series_name(None if single else name, point))
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
        written.append(out / filename)
        fig.savefig(written[-1], dpi=100)

    axis = _load_axis(runs)
    fig, (req_ax, tok_ax) = _figure(ncols=2)
    ttft_fig, (ttft_ax,) = _figure()
    for name, run in runs:
        xs = _xs(run)
        metrics = [p.metrics for p in run.points]
        req_ax.plot(xs, [m.request_throughput for m in metrics], marker="o", label=name)
        tok_ax.plot(xs, [m.output_throughput for m in metrics], marker="o", label=name)
        p99 = [
            (x, m.ttft_ms.p99)
            for x, m in zip(xs, metrics, strict=True)
            if m.ttft_ms.p99 is not None
        ]
        ttft_ax.plot([x for x, _ in p99], [y for _, y in p99], marker="o", label=name)
    req_ax.set(title="request throughput", xlabel=axis, ylabel="requests/s")
    tok_ax.set(title="output token throughput", xlabel=axis, ylabel="tokens/s")
    ttft_ax.set(title="p99 TTFT", xlabel=axis, ylabel="ms")
    for ax in (req_ax, tok_ax, ttft_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for f, filename in ((fig, LOAD_CHARTS[0]), (ttft_fig, LOAD_CHARTS[1])):
        written.append(out / filename)
        f.savefig(written[-1], dpi=100)
    return written
