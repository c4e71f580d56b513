"""Turn ``results/latest.json`` into the printed table and ``benchmarks/README.md``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import contention_table, moe_bench, structured, ttft
from benchmarks.roofline import attainable_gflops

BASELINE_LAYOUTS = {"shardserve": "tp1 pp1", "hf-serve": "tp1 pp1", "hf-generate": "batch"}
SYSTEMS = ("shardserve", "hf-serve", "hf-generate")


def row_key(row: dict[str, Any]) -> tuple[str, str, int, str]:
    return (row["system"], row["dtype"], row["concurrency"], row["layout"])


def _row(rows: list[dict[str, Any]], *key: Any) -> dict[str, Any] | None:
    return next((r for r in rows if row_key(r) == key), None)


def add_run(
    rows: list[dict[str, Any]], key: tuple[str, str, int, str], run: dict[str, Any]
) -> dict[str, Any]:
    """Record one run of the point ``key`` (system, dtype, concurrency, layout); the point's
    row keeps every run under ``runs`` and takes its fields from the median one (the lower
    median for an even count: always a run that happened, never an average)."""
    row = _row(rows, *key)
    if row is None:
        system, dtype, c, layout = key
        row = {"system": system, "dtype": dtype, "concurrency": c, "layout": layout, "runs": []}
        rows.append(row)
    row["runs"].append(run)
    ordered = sorted(row["runs"], key=lambda r: float(r["output_throughput"]))
    row.update(ordered[(len(ordered) - 1) // 2])
    return row


def _find(rows: list[dict[str, Any]], system: str, dtype: str, c: int, layout: str) -> float | None:
    row = _row(rows, system, dtype, c, layout)
    return None if row is None else float(row["output_throughput"])


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "—"


def _tok_cell(row: dict[str, Any]) -> str:
    """tok/s, and the range of the runs where the point ran more than once (median shown)."""
    text = f"{float(row['output_throughput']):.1f}"
    runs = [float(run["output_throughput"]) for run in row.get("runs", [])]
    return f"{text} ({min(runs):.0f}–{max(runs):.0f})" if len(runs) > 1 else text


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
            row = _row(rows, system, dtype, c, layout)
            if row is None:
                continue
            tok_s = float(row["output_throughput"])
            gflops, pct = _roof(result, row)
            vs_serve = _ratio(tok_s, serve) if system != "hf-serve" else ""
            vs_gen = _ratio(tok_s, gen) if system != "hf-generate" else ""
            lines.append(
                f"| {system} | {dtype} | {c} | {_tok_cell(row)} | {vs_serve} | {vs_gen} "
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
        ratio = f"{_ratio(tok[layout], tok.get(base))} vs {base}" if base else ""
        lines.append(f"| {layout} | {_tok_cell(row)} | {ratio} | {gflops:.1f} |")
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
        vs_serve = _ratio(tok[system], tok.get("hf-serve")) if system != "hf-serve" else ""
        vs_gen = _ratio(tok[system], tok.get("hf-generate")) if system != "hf-generate" else ""
        lines.append(f"| {system} | {_tok_cell(row)} | {vs_serve} | {vs_gen} |")
    return "\n".join(lines)


def roofline_text(result: dict[str, Any]) -> str:
    roof, model = result["roofline"], result["model"]
    parts = [f"- memory bandwidth (large tensor copy, read + write): {roof['copy_gbps']:.1f} GB/s"]
    for dtype, g in roof["gemm_gflops"].items():
        square = next(v for k, v in g.items() if k.startswith("square"))
        parts.append(
            f"- {dtype} matmul, {roof['threads']} threads: "
            f"[64,576]×[576,1536] {g['decode_64x576x1536']:.1f} GFLOP/s, "
            f"2048² square {square:.1f} GFLOP/s (peak used: {g['peak']:.1f})"
        )
    parts.append(
        f"- model: {model['parameters'] / 1e6:.1f} M parameters, "
        f"{model['matmul_parameters'] / 1e6:.1f} M in matmuls (LM head included); "
        f"{model['flops_per_output_token'] / 1e6:.0f} MFLOP per output token "
        f"(decode + attention + the prompt's prefill shared over 64 outputs)"
    )
    return "\n".join(parts)


def render(result: dict[str, Any]) -> str:
    notes = "\n".join(f"- {n}" for n in result["notes"]) or "- none"
    return "\n\n".join(
        [
            main_table(result),
            ttft.ttft_table(result),
            parallel_table(result),
            family_table(result),
            moe_bench.moe_table(result),
            structured.structured_table(result),
            contention_table.contention_table(result),
            roofline_text(result),
            "Notes:\n" + notes,
        ]
    )


def write_readme(result: dict[str, Any], path: Path) -> None:
    template = (Path(__file__).resolve().parent / "README.template.md").read_text()
    m = result["machine"]
    machine = (
        f"{m['cpu']}, {m['cores_usable']} usable cores (os.cpu_count {m['cores']}), "
        f"torch {m['torch']}, transformers {m['transformers']}, "
        f"Python {m['python']}, {m['date']}; whole run {result['wall_s'] / 60:.1f} min"
    )
    notes = "\n".join(f"- {n}" for n in result["notes"]) or "- none"
    fields = {
        "machine": machine,
        "main_table": main_table(result),
        "ttft_table": ttft.ttft_table(result),
        "parallel_table": parallel_table(result),
        "family_table": family_table(result),
        "moe_table": moe_bench.moe_table(result),
        "structured_table": structured.structured_table(result),
        "contention_table": contention_table.contention_table(result),
        "roofline": roofline_text(result),
        "notes": notes,
    }
    text = template
    for key, value in fields.items():  # not str.format: the template has JSON braces
        text = text.replace("{" + key + "}", value)
    path.write_text(text)
