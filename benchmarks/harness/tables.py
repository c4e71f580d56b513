"""Rows of a run and the cells every table shares.

A row is one point: ``system``, ``dtype``, ``concurrency``, ``layout`` (the key), its
``output_throughput`` and ``metrics``; a point run more than once keeps each run under
``runs`` (:func:`add_run`). Each suite renders its own table from the rows.
"""

from __future__ import annotations

from typing import Any

Key = tuple[str, str, int, str]
"""(system, dtype, concurrency, layout)."""


def row_key(row: dict[str, Any]) -> Key:
    return (row["system"], row["dtype"], row["concurrency"], row["layout"])


def find_row(rows: list[dict[str, Any]], *key: Any) -> dict[str, Any] | None:
    return next((r for r in rows if row_key(r) == key), None)


def add_run(rows: list[dict[str, Any]], key: Key, run: dict[str, Any]) -> dict[str, Any]:
    """Record one run of the point ``key``; the point's row keeps every run under ``runs``
    and takes its fields from the median one (the lower median for an even count: always a
    run that happened, never an average)."""
    row = find_row(rows, *key)
    if row is None:
        system, dtype, c, layout = key
        row = {"system": system, "dtype": dtype, "concurrency": c, "layout": layout, "runs": []}
        rows.append(row)
    row["runs"].append(run)
    ordered = sorted(row["runs"], key=lambda r: float(r["output_throughput"]))
    row.update(ordered[(len(ordered) - 1) // 2])
    return row


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``1.23×``; ``—`` when either is missing or zero."""
    return f"{a / b:.2f}×" if a and b else "—"


def tok_cell(row: dict[str, Any]) -> str:
    """tok/s, and the range of the runs where the point ran more than once (median shown)."""
    text = f"{float(row['output_throughput']):.1f}"
    runs = [float(run["output_throughput"]) for run in row.get("runs", [])]
    return f"{text} ({min(runs):.0f}–{max(runs):.0f})" if len(runs) > 1 else text
