"""The throughput tables of ``make bench``: shardserve against ``transformers serve`` and padded
``generate()`` on the bench model, then its tp/pp layouts and the Qwen3-shaped family.

:func:`sweep`: 32-token prompts and 64 greedy output tokens at each concurrency and dtype,
every system in turn; :func:`run_parallel`: at concurrency 32 in float32, tp=2 against tp=1
(12-head variant) and pp=2 overlapped against not; :func:`run_families`: the Qwen3-shaped
variant against both baselines. :func:`main_table`, :func:`parallel_table` and
:func:`family_table` render them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from benchmarks.harness.bench import (
    PARALLEL_CONCURRENCY,
    Bench,
    alternate,
    start_hf_serve,
    start_ours,
)
from benchmarks.harness.model import Variant, ensure_model
from benchmarks.harness.roofline import attainable_gflops
from benchmarks.harness.tables import find_row, ratio, tok_cell

BASELINE_LAYOUTS = {"shardserve": "tp1 pp1", "hf-serve": "tp1 pp1", "hf-generate": "batch"}
SYSTEMS = ("shardserve", "hf-serve", "hf-generate")
FAMILY_LAYOUT = "qwen3-shaped"


def sweep(bench: Bench, dtype: str, systems: list[str]) -> None:
    """Both servers up at once; at each concurrency every system runs back to back, so
    the load other work puts on the shared cores hits them alike."""
    with contextlib.ExitStack() as stack:
        targets = []
        if "shardserve" in systems:
            targets.append(start_ours(stack, dtype, [], "tp1 pp1"))
        if "hf-serve" in systems:
            targets.append(start_hf_serve(stack, dtype, bench.model))
        for target in targets:
            bench.http_point(target, dtype, None, "")
        for c in bench.concurrencies:
            alternate(bench, [(t, "tp1 pp1") for t in targets], dtype, c)
            if "hf-generate" in systems:
                bench.generate_point(dtype, c)


def run_parallel(bench: Bench, flag_help: str) -> None:
    """tp=2 vs tp=1 (12-head variant: 9 heads do not split in 2) and pp=2 overlap on/off."""
    c = PARALLEL_CONCURRENCY
    pp2 = ["-pp", "2"]
    if "--pp-layer-partition" in flag_help:  # the LM-head stage takes fewer layers
        pp2 += ["--pp-layer-partition", "balanced"]
    pairs: list[list[tuple[list[str], str, Variant]]] = [
        [([], "tp1 (12-head variant)", "tp2"), (["-tp", "2"], "tp2 (12-head variant)", "tp2")],
        [(pp2, "pp2 overlapped", "main")],
    ]
    if "--no-pipeline-overlap" in flag_help:
        pairs[1].append(([*pp2, "--no-pipeline-overlap"], "pp2 not overlapped", "main"))
    else:
        bench.notes.append(
            "pp2 not overlapped: skipped, `shardserve serve` has no "
            "--no-pipeline-overlap flag in this checkout"
        )
    for pair in pairs:  # both servers of a pair up at once, measured in turn
        with contextlib.ExitStack() as stack:
            targets = []
            for flags, layout, variant in pair:
                target = start_ours(stack, "float32", flags, layout, variant)
                bench.http_point(target, "float32", None, "")
                targets.append((target, layout))
            alternate(bench, targets, "float32", c)


def run_families(bench: Bench) -> None:
    """The Qwen3-shaped variant at concurrency 32 in float32: ours against ``transformers
    serve`` (both up, alternating) and ``generate()``, the main table's ratios."""
    c, dtype = PARALLEL_CONCURRENCY, "float32"
    model = ensure_model("qwen3")
    with contextlib.ExitStack() as stack:
        ours = start_ours(stack, dtype, [], FAMILY_LAYOUT, "qwen3")
        hf = start_hf_serve(stack, dtype, model)
        for target in (ours, hf):
            bench.http_point(target, dtype, None, "")
        alternate(bench, [(ours, FAMILY_LAYOUT), (hf, FAMILY_LAYOUT)], dtype, c)
    bench.generate_point(dtype, c, model, FAMILY_LAYOUT)


def _find(rows: list[dict[str, Any]], system: str, dtype: str, c: int, layout: str) -> float | None:
    row = find_row(rows, system, dtype, c, layout)
    return None if row is None else float(row["output_throughput"])


def _ttft_cell(row: dict[str, Any]) -> str:
    """The point's median time to first token (HTTP systems; ``generate()`` has none)."""
    p50 = (row.get("metrics") or {}).get("ttft_ms", {}).get("p50")
    return "—" if p50 is None else f"{float(p50):.0f}"


def _roof(result: dict[str, Any], row: dict[str, Any]) -> tuple[float, float]:
    """Achieved GFLOP/s and its % of the roofline at this batch size."""
    gflops = row["output_throughput"] * result["model"]["flops_per_output_token"] / 1e9
    ceiling = attainable_gflops(result["roofline"], row["dtype"], row["concurrency"])
    return gflops, 100 * gflops / ceiling


def main_table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "| system | dtype | conc. | output tok/s | vs hf-serve | vs hf-generate "
        "| GFLOP/s | % roofline | TTFT p50 ms | load |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = sorted(
        {
            (r["dtype"], r["concurrency"])
            for r in rows
            if r["layout"] == BASELINE_LAYOUTS.get(r["system"])
        },
        key=lambda k: (k[0] != "float32", k[1]),
    )
    for dtype, c in keys:
        serve = _find(rows, "hf-serve", dtype, c, "tp1 pp1")
        gen = _find(rows, "hf-generate", dtype, c, "batch")
        for system in SYSTEMS:
            layout = BASELINE_LAYOUTS[system]
            row = find_row(rows, system, dtype, c, layout)
            if row is None:
                continue
            tok_s = float(row["output_throughput"])
            gflops, pct = _roof(result, row)
            vs_serve = ratio(tok_s, serve) if system != "hf-serve" else ""
            vs_gen = ratio(tok_s, gen) if system != "hf-generate" else ""
            lines.append(
                f"| {system} | {dtype} | {c} | {tok_cell(row)} | {vs_serve} | {vs_gen} "
                f"| {gflops:.1f} | {pct:.0f}% | {_ttft_cell(row)} "
                f"| {row.get('loadavg_before', 0.0):.1f} |"
            )
    return "\n".join(lines)


def parallel_table(result: dict[str, Any]) -> str:
    rows = [
        r
        for r in result["rows"]
        if r["system"] == "shardserve" and r["dtype"] == "float32" and r["concurrency"] == 32
    ]
    if not rows:
        return "(not measured)"
    tok = {r["layout"]: float(r["output_throughput"]) for r in rows}
    lines = [
        "| layout (shardserve, float32, conc. 32) | output tok/s | ratio | GFLOP/s |",
        "|---|---:|---:|---:|",
    ]
    pairs = {
        "tp1 (12-head variant)": None,
        "tp2 (12-head variant)": "tp1 (12-head variant)",
        "tp1 pp1": None,
        "pp2 not overlapped": "tp1 pp1",
        "pp2 overlapped": "pp2 not overlapped",  # the target: overlap's gain
    }
    for layout, base in pairs.items():
        if layout not in tok:
            continue
        row = next(r for r in rows if r["layout"] == layout)
        gflops, _ = _roof(result, row)
        vs_base = f"{ratio(tok[layout], tok.get(base))} vs {base}" if base else ""
        lines.append(f"| {layout} | {tok_cell(row)} | {vs_base} | {gflops:.1f} |")
    return "\n".join(lines)


def family_table(result: dict[str, Any]) -> str:
    """The Qwen3-shaped rows (float32, concurrency 32): ours against both baselines."""
    rows = [r for r in result["rows"] if r["layout"] == "qwen3-shaped"]
    tok = {r["system"]: float(r["output_throughput"]) for r in rows}
    lines = [
        "| system (Qwen3-shaped, float32, conc. 32) | output tok/s | vs hf-serve "
        "| vs hf-generate |",
        "|---|---:|---:|---:|",
    ]
    for system in SYSTEMS:
        row = next((r for r in rows if r["system"] == system), None)
        if row is None:
            continue
        vs_serve = ratio(tok[system], tok.get("hf-serve")) if system != "hf-serve" else ""
        vs_gen = ratio(tok[system], tok.get("hf-generate")) if system != "hf-generate" else ""
        lines.append(f"| {system} | {tok_cell(row)} | {vs_serve} | {vs_gen} |")
    return "\n".join(lines)
