"""When to send each request: gamma-distributed inter-arrival times.

With shape ``B`` (burstiness) and scale ``1 / (R * B)`` the gaps have mean ``1 / R``
and squared coefficient of variation ``1 / B``: ``B = 1`` is a Poisson process (the
same model as ``vllm bench serve --burstiness``), ``B < 1`` burstier, ``B > 1`` smoother.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def inter_arrival_gaps(rate: float, burstiness: float, seed: int | str) -> Iterator[float]:
    """Endless gaps in seconds (mean ``1 / rate``); the same seed yields the same gaps."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    rng = random.Random(f"arrivals:{seed}")
    scale = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def arrival_offsets(rate: float, burstiness: float, seed: int | str) -> Iterator[float]:
    """Endless send times in seconds after the start: cumulative sums of the gaps."""
    t = 0.0
    for gap in inter_arrival_gaps(rate, burstiness, seed):
        t += gap
        yield t


def arrival_schedule(n: int, rate: float, burstiness: float, seed: int | str) -> list[float]:
    """The first ``n`` send times of :func:`arrival_offsets` (what a seeded run uses)."""
    offsets = arrival_offsets(rate, burstiness, seed)
    return [next(offsets) for _ in range(n)]
