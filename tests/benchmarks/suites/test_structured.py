"""The structured-output table of ``make bench``: both kinds' median tok/s and their ratio."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import tables
from benchmarks.suites.structured import LAYOUTS, structured_table


def test_structured_table_shows_the_ratio() -> None:
    rows: list[dict[str, Any]] = []
    for kind, values in (("free", [100.0, 90.0]), ("json", [88.0, 81.0])):
        for tok_s in values:
            run = {"output_throughput": tok_s, "loadavg_before": 0.0, "metrics": {}}
            tables.add_run(rows, ("shardserve", "float32", 32, LAYOUTS[kind]), run)
    table = structured_table({"rows": rows})
    assert "| unconstrained | 32 | 90.0 (90–100) | |" in table
    assert "| json_schema | 32 | 81.0 (81–88) | 0.90× |" in table
    assert structured_table({"rows": []}) == "(not measured)"
