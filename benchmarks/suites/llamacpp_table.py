"""The llama.cpp table (:mod:`benchmarks.suites.llamacpp_peer`'s rows): per GGUF type and
concurrency, shardserve's output tok/s over llama-server's on the same file, time to first
token at concurrency 1 and the peak RSS per rank of both; then shardserve's quantized
throughput at c=32 against its own bfloat16 on the dequantized weights.

Rows: ``system`` ``shardserve`` or ``llama.cpp``, ``dtype`` the GGUF type served (or
``bfloat16``: shardserve on the dequantized Hugging Face directory), ``layout`` ``LAYOUT``;
``peak_rss_mib`` is ``{"ranks": [MiB, ...], "frontend": MiB or None}``.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.gguf_models import KINDS
from benchmarks.harness.tables import find_row, ratio, tok_cell

LAYOUT = "smollm2 vs llama.cpp"
OURS, LLAMA = "shardserve", "llama.cpp"
BASELINE = "bfloat16"
TARGET_CONCURRENCY = 32


def _tok(row: dict[str, Any] | None) -> float | None:
    return None if row is None else float(row["output_throughput"])


def _ttft(row: dict[str, Any] | None) -> str:
    p50 = None if row is None else (row.get("metrics") or {}).get("ttft_ms", {}).get("p50")
    return "—" if p50 is None else f"{float(p50):.0f}"


def _rank_rss(row: dict[str, Any] | None) -> str:
    """The largest rank's peak RSS in MiB."""
    ranks = [r for r in ((row or {}).get("peak_rss_mib") or {}).get("ranks", []) if r]
    return f"{max(ranks):.0f}" if ranks else "—"


def _ours(rows: list[dict[str, Any]], kind: str, c: int) -> tuple[dict[str, Any] | None, str]:
    """shardserve's row beside llama.cpp's ``kind``: on the same file, else its bfloat16."""
    row = find_row(rows, OURS, kind, c, LAYOUT)
    if row is not None:
        return row, f"the {kind} file"
    return find_row(rows, OURS, BASELINE, c, LAYOUT), f"{BASELINE}, dequantized"


def _peer_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for kind in KINDS:
        concs = sorted(
            {r["concurrency"] for r in rows if (r["system"], r["dtype"]) == (LLAMA, kind)}
        )
        for i, c in enumerate(concs):
            theirs = find_row(rows, LLAMA, kind, c, LAYOUT)
            ours, serves = _ours(rows, kind, c)
            ttft = f"{_ttft(ours)} / {_ttft(theirs)}" if c == 1 else ""
            rss = f"{_rank_rss(ours)} / {_rank_rss(theirs)}" if i == 0 else ""
            ours_tok = tok_cell(ours) if ours else "—"
            lines.append(
                f"| {kind} | {c} | {serves} | {ours_tok} | {tok_cell(theirs) if theirs else '—'} "
                f"| {ratio(_tok(ours), _tok(theirs))} | {ttft} | {rss} |"
            )
    return lines


def _baseline_lines(rows: list[dict[str, Any]]) -> list[str]:
    c = TARGET_CONCURRENCY
    base = find_row(rows, OURS, BASELINE, c, LAYOUT)
    quantized = [(k, find_row(rows, OURS, k, c, LAYOUT)) for k in KINDS]
    measured = [(k, row) for k, row in quantized if row is not None]
    if not measured:
        where = f"{_tok(base):.1f} tok/s" if base else "not measured"
        return [
            f"shardserve {BASELINE} on the dequantized weights at c={c}: {where}; "
            "shardserve served no GGUF file in this run."
        ]
    lines = [
        f"| GGUF type (c={c}) | shardserve on the file, tok/s | shardserve {BASELINE}, tok/s "
        "| quantized / bfloat16 |",
        "|---|---:|---:|---:|",
    ]
    for kind, row in measured:
        base_cell = tok_cell(base) if base else "—"
        lines.append(f"| {kind} | {tok_cell(row)} | {base_cell} | {ratio(_tok(row), _tok(base))} |")
    return lines


def peer_table(result: dict[str, Any]) -> str:
    rows = [r for r in result["rows"] if r.get("layout") == LAYOUT]
    if not rows:
        return "(not measured)"
    lines = [
        "| GGUF type | conc. | shardserve serves | shardserve tok/s | llama.cpp tok/s "
        "| shardserve / llama.cpp | TTFT p50 ms (shardserve / llama.cpp) "
        "| peak RSS per rank MiB (shardserve / llama.cpp) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
        *_peer_lines(rows),
    ]
    frontends = sorted(
        {
            f"{(r.get('peak_rss_mib') or {}).get('frontend'):.0f}"
            for r in rows
            if r["system"] == OURS and (r.get("peak_rss_mib") or {}).get("frontend")
        }
    )
    if frontends:
        lines.append(
            f"\nshardserve's frontend process (HTTP, tokenizer; no rank): "
            f"{', '.join(frontends)} MiB peak RSS."
        )
    return "\n".join([*lines, "", *_baseline_lines(rows)])
