"""Per-point numbers from raw records: throughputs, goodput, latency statistics.

Latencies come from successful requests only; ITL pools every gap of every successful
request. Throughputs divide by the point's wall time (first send to last answer, or to
the ``--duration`` deadline).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from deploy.loadtest_lib.config import SLO
from deploy.loadtest_lib.records import RequestRecord


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation (numpy's default method)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Stats:
    """mean / p50 / p90 / p99 of ``count`` samples in milliseconds (all ``None`` if none)."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        ordered = sorted(values)
        if not ordered:
            return cls()
        return cls(
            count=len(ordered),
            mean=sum(ordered) / len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
        )


LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SpecTotals = tuple[float, float, float]  # a server's drafts, draft tokens, accepted tokens


@dataclass(frozen=True, slots=True)
class PointMetrics:
    """Summary of one load point.

    ``sent`` requests went out; ``completed`` succeeded; ``errors`` counts every other
    outcome by status (``http_500``, ``timeout``, ``cancelled``, ...), so
    ``sent == completed + sum(errors.values())``. Throughputs are per second of
    ``duration_s``; ``goodput`` (requests/s meeting every SLO) is ``None`` without SLOs.
    """

    duration_s: float
    sent: int
    completed: int
    errors: dict[str, int]
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    goodput: float | None
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    # speculative decoding over the point, when the server's /metrics has its counters:
    # proposed tokens accepted (0..1), and tokens per verify step (1 + accepted / drafts)
    spec_acceptance: float | None = None
    spec_tokens_per_step: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PointMetrics:
        fields = dict(data)
        for name in LATENCIES:
            fields[name] = Stats(**fields[name])
        return cls(**fields)


def with_spec_decode(
    metrics: PointMetrics, before: SpecTotals | None, after: SpecTotals | None
) -> PointMetrics:
    """``metrics`` with the acceptance of the verify steps between two ``/metrics`` readings
    (unchanged when the server exposes none, or made no proposal)."""
    if before is None or after is None:
        return metrics
    drafts, tokens, accepted = (a - b for a, b in zip(after, before, strict=True))
    if drafts <= 0 or tokens <= 0:
        return metrics
    return replace(
        metrics, spec_acceptance=accepted / tokens, spec_tokens_per_step=1 + accepted / drafts
    )


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """A successful request within every set objective (TPOT is vacuous for 1 token)."""
    if not record.ok:
        return False
    checks = (
        (slo.ttft_ms, record.ttft_ms),
        (slo.tpot_ms, record.tpot_ms),
        (slo.e2e_ms, record.e2e_ms),
    )
    return all(limit is None or value is None or value <= limit for limit, value in checks)


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> PointMetrics:
    """Summarize ``records`` (every request sent at one point) over ``duration_s`` seconds."""
    ok = [r for r in records if r.ok]
    errors = dict(sorted(Counter(r.status for r in records if not r.ok).items()))
    per_second = 1.0 / duration_s if duration_s > 0 else 0.0
    output_tokens = sum(r.output_tokens for r in ok)
    return PointMetrics(
        duration_s=duration_s,
        sent=len(records),
        completed=len(ok),
        errors=errors,
        input_tokens=sum(r.prompt_tokens or 0 for r in ok),
        output_tokens=output_tokens,
        request_throughput=len(ok) * per_second,
        output_throughput=output_tokens * per_second,
        goodput=None if slo.empty else sum(meets_slo(r, slo) for r in ok) * per_second,
        ttft_ms=Stats.of(r.ttft_ms for r in ok if r.ttft_ms is not None),
        tpot_ms=Stats.of(t for r in ok if (t := r.tpot_ms) is not None),
        itl_ms=Stats.of(gap for r in ok for gap in r.itl_ms),
        e2e_ms=Stats.of(r.e2e_ms for r in ok if r.e2e_ms is not None),
    )
