"""Plain-text tables for stdout: a run's summary, and two runs side by side."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from deploy.loadtest_lib.metrics import LATENCIES, PointMetrics, Stats
from deploy.loadtest_lib.results import PointResult, RunResult

LATENCY_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _errors(metrics: PointMetrics) -> str:
    return ", ".join(f"{k}={v}" for k, v in metrics.errors.items()) or "none"


def _point_block(point: PointResult) -> list[str]:
    m = point.metrics
    lines = [
        f"== {point.load.label}: {m.sent} sent, {m.completed} ok, errors: {_errors(m)}, "
        f"{m.duration_s:.2f} s",
        f"   requests/s {_num(m.request_throughput, 2)}   output tokens/s "
        f"{_num(m.output_throughput)}   goodput {_num(m.goodput, 2)} req/s   "
        f"tokens in/out {m.input_tokens}/{m.output_tokens}",
        f"   {'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'n':>8}",
    ]
    if m.spec_acceptance is not None:
        lines.insert(
            2,
            f"   speculative decoding: {_num(100 * m.spec_acceptance, 1)}% of proposed tokens "
            f"accepted, {_num(m.spec_tokens_per_step, 2)} tokens per verify step",
        )
    for name in LATENCIES:
        s: Stats = getattr(m, name)
        row = "".join(f"{_num(v, 2):>10}" for v in (s.mean, s.p50, s.p90, s.p99))
        lines.append(f"   {LATENCY_NAMES[name]:<6}{row}{s.count:>8}")
    return lines


def format_summary(result: RunResult) -> str:
    """Per point a block (throughputs, errors by kind, latency mean/p50/p90/p99); with
    several points, then one overview row per point."""
    c = result.config
    lines = [
        f"{c.model} @ {c.base_url} /{c.endpoint}  prompts: {result.prompt_source}"
        + (f" ({c.dataset})" if c.dataset else f" in={c.input_len} out={c.output_len}")
    ]
    for point in result.points:
        lines += _point_block(point)
    if len(result.points) > 1:
        header = ["load", "ok/sent", "req/s", "out tok/s", "goodput", "TTFT p99", "TPOT mean"]
        rows = [
            [
                p.load.label,
                f"{p.metrics.completed}/{p.metrics.sent}",
                _num(p.metrics.request_throughput, 2),
                _num(p.metrics.output_throughput),
                _num(p.metrics.goodput, 2),
                _num(p.metrics.ttft_ms.p99),
                _num(p.metrics.tpot_ms.mean, 2),
            ]
            for p in result.points
        ]
        lines += ["", "== sweep", *_table(header, rows)]
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    first = "  ".join(
        h.ljust(w) if i == 0 else h.rjust(w)
        for i, (h, w) in enumerate(zip(header, widths, strict=True))
    )
    body = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return [first, *body]


Getter = Callable[[PointMetrics], float | None]


def _latency(metrics: PointMetrics, name: str, stat: str) -> float | None:
    value: float | None = getattr(getattr(metrics, name), stat)
    return value


def _compared() -> tuple[tuple[str, Getter], ...]:
    rows: list[tuple[str, Getter]] = [
        ("requests/s", lambda m: m.request_throughput),
        ("output tok/s", lambda m: m.output_throughput),
        ("goodput req/s", lambda m: m.goodput),
        ("errors", lambda m: float(sum(m.errors.values()))),
    ]
    for name in LATENCIES:
        for stat in ("mean", "p50", "p99"):
            label = f"{LATENCY_NAMES[name]} {stat} ms"
            rows.append((label, partial(_latency, name=name, stat=stat)))
    return tuple(rows)


COMPARED = _compared()


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{b / a:.3f}x"


def format_comparison(a: RunResult, b: RunResult, name_a: str, name_b: str) -> str:
    """Points matched by position; per metric ``A``, ``B`` and ``B/A``. Mismatched loads
    and extra points are reported, never silently paired."""
    lines = [f"A = {name_a} ({a.config.model}), B = {name_b} ({b.config.model})"]
    for i in range(max(len(a.points), len(b.points))):
        if i >= len(a.points) or i >= len(b.points):
            only = name_a if i < len(a.points) else name_b
            lines += ["", f"== point {i + 1}: only in {only}"]
            continue
        pa, pb = a.points[i], b.points[i]
        title = (
            pa.load.label
            if pa.load == pb.load
            else f"{pa.load.label} vs {pb.load.label} (loads differ)"
        )
        rows = [
            [
                label,
                _num(get(pa.metrics), 2),
                _num(get(pb.metrics), 2),
                _ratio(get(pa.metrics), get(pb.metrics)),
            ]
            for label, get in COMPARED
        ]
        lines += ["", f"== point {i + 1}: {title}", *_table(["metric", "A", "B", "B/A"], rows)]
    return "\n".join(lines)
