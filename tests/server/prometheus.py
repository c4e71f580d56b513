"""Prometheus text exposition parsed into samples, for the /metrics tests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as ``(name, sorted labels) -> value``."""
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("shardserve_"), family.name
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out
