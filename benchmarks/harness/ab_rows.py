"""Two kinds of requests on one server compared (structured output against none, LoRA
adapters against the base model): rounds that alternate them, their table, the suite alone."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.bench import Bench
from benchmarks.harness.machine import machine
from benchmarks.harness.tables import ratio, tok_cell

# point(dataset, kind, record): one load point of ``kind``, recorded unless a warm-up
Point = Callable[[str, str, bool], None]


def alternate(
    point: Point, datasets: list[str], kinds: tuple[str, str], rounds: int, warm: str
) -> None:
    """An untimed point of ``warm`` on ``datasets[-1]`` (the first full batch is slow), then
    ``rounds`` rounds of both kinds on ``datasets[2 r]``, ``datasets[2 r + 1]``, the order
    reversed every other round (a slow spell falls on both alike)."""
    point(datasets[-1], warm, False)
    for r in range(rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for i, kind in enumerate(order):
            point(datasets[2 * r + i], kind, True)


def pair_table(
    result: dict[str, Any], layouts: tuple[str, str], labels: tuple[str, str], versus: str
) -> str:
    """The baseline's and the other kind's median tok/s (rows of ``layouts``, named
    ``labels``) and their ratio under ``versus``; ``(not measured)`` without both."""
    rows = {r["layout"]: r for r in result["rows"] if r["layout"] in layouts}
    base, other = rows.get(layouts[0]), rows.get(layouts[1])
    if base is None or other is None:
        return "(not measured)"
    vs = ratio(float(other["output_throughput"]), float(base["output_throughput"]))
    return "\n".join(
        [
            f"| requests (float32, shardserve) | conc. | output tok/s | {versus} |",
            "|---|---:|---:|---:|",
            f"| {labels[0]} | {base['concurrency']} | {tok_cell(base)} | |",
            f"| {labels[1]} | {other['concurrency']} | {tok_cell(other)} | {vs} |",
        ]
    )


def run_alone(
    description: str,
    out: str,
    rounds: int,
    run: Callable[[Bench, int, int], None],
    table: Callable[[dict[str, Any]], str],
    argv: list[str] | None,
) -> int:
    """A suite's rows alone (``--concurrency``, ``--rounds``), written to ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", default=out)
    args = parser.parse_args(argv)
    bench = Bench([args.concurrency])
    run(bench, args.concurrency, args.rounds)
    result = {"machine": machine(), "rows": bench.rows, "notes": bench.notes}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print("\n".join(f"- {n}" for n in bench.notes))
    return 0
