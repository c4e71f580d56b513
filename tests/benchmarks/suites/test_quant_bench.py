"""The quantized-checkpoint table of ``make bench`` from rows, without running anything."""

from __future__ import annotations

from typing import Any

from benchmarks.suites.quant_bench import LAYOUTS, quant_table


def _row(layout: str, c: int, tok_s: float) -> dict[str, Any]:
    row = {"system": "shardserve", "dtype": "bfloat16", "concurrency": c, "layout": layout}
    return {**row, "output_throughput": tok_s}


def test_quant_table_puts_each_format_beside_dense() -> None:
    rows = [_row(LAYOUTS[f], c, t) for f, t in (("awq", 30.0), ("dense", 20.0)) for c in (1, 32)]
    rows.append(_row(LAYOUTS["fp8"], 32, 10.0))
    rows.append(_row("tp1 pp1", 32, 99.0))  # another table's row
    lines = quant_table({"rows": rows}).splitlines()
    assert lines[2:] == [
        f"| {LAYOUTS['dense']} | 1 | 20.0 |  |",
        f"| {LAYOUTS['awq']} | 1 | 30.0 | 1.50× |",
        f"| {LAYOUTS['dense']} | 32 | 20.0 |  |",
        f"| {LAYOUTS['fp8']} | 32 | 10.0 | 0.50× |",
        f"| {LAYOUTS['awq']} | 32 | 30.0 | 1.50× |",
    ]
    assert quant_table({"rows": []}) == "(not measured)"
