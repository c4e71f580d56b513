"""A point run more than once: its row shows the median run, and keeps every run."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import tables


def _repeated(layout: str, tok_s: list[float]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for t in tok_s:
        tables.add_run(rows, ("shardserve", "float32", 32, layout), {"output_throughput": t})
    (row,) = rows
    return row


def test_a_repeated_point_reports_its_median_run() -> None:
    assert _repeated("x", [97.0, 84.0, 90.0])["output_throughput"] == 90.0
    # an even count: the lower of the two middle runs, a run that happened, not a mean
    row = _repeated("x", [97.0, 84.0, 90.0, 85.0])
    assert row["output_throughput"] == 85.0 and len(row["runs"]) == 4
    assert row["layout"] == "x" and row["concurrency"] == 32
