"""The ``make gpu-check`` report: every number with its target, met or not, or why missing.

:func:`rows` turns a results dict (``benchmarks/results/gpu-check.json``) into table rows
``(check, value, target, status)``; status is ``met``, ``not met``, ``missing`` or empty
(no target). A number that was not measured shows ``missing: <reason>``, the reason
taken from ``results["missing"]`` under the longest matching key (``ours`` covers
``ours.c1``), so a derived number names the measurement it lacked. Targets:

- % of HBM roofline at c=1 ≥ 75 % (:func:`benchmarks.gpu.shapes.roofline_fraction`
  on the decode rate 1000 / median TPOT);
- ours at c=32 / HF ``generate()`` at batch 32 ≥ 5×;
- CUDA graph capture (the server's own ``captured ... in X s``) < 60 s;
- parity: every test run passes, none fails or errors, within the time cap;
- the step, the ceiling and the families: :mod:`benchmarks.gpu.report_step`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.gpu import quant_report
from benchmarks.gpu.report_step import device_rows, parity_rows, sections
from benchmarks.gpu.report_values import Row, Value, lookup, measured, ratio, reason
from benchmarks.gpu.report_values import fmt as _fmt
from benchmarks.gpu.report_values import si as _si
from benchmarks.gpu.report_values import status as _status
from benchmarks.gpu.shapes import roofline_fraction

TARGET_ROOFLINE = 0.75
TARGET_RATIO_C32 = 5.0
TARGET_CAPTURE_S = 60.0


def roofline(results: dict[str, Any]) -> Value:
    tok_s = measured(results, "ours.c1.decode_tok_s")
    if tok_s.number is None:
        return Value(None, f"needs ours c=1 decode tok/s ({tok_s.why})")
    bytes_per_token = lookup(results, "model.bytes_per_token")
    peak = results.get("peak_bw")
    if not peak:
        return Value(None, "no peak bandwidth known for this device: pass --peak-bw")
    frac = roofline_fraction(tok_s.number, float(bytes_per_token), float(peak))
    detail = f"{tok_s.number:.1f} tok/s × {_si(bytes_per_token)}B / {_si(peak)}B/s"
    return Value(frac, detail=detail)


def capture(results: dict[str, Any]) -> Value:
    secs = measured(results, "ours.startup.graph_capture_s")
    if secs.number is not None:
        count = lookup(results, "ours.startup.graph_count")
        return Value(secs.number, detail=f"{count} graphs, per the server log")
    if disabled := lookup(results, "ours.startup.graphs_disabled"):
        return Value(None, f"the server logged: {disabled}")
    if lookup(results, "ours.startup.weights_read_s") is not None:
        return Value(None, "no 'captured N CUDA graphs ... in X s' line in the server log")
    return Value(None, reason(results, "ours.startup"))


def startup_rows(results: dict[str, Any]) -> list[Row]:
    weights = measured(results, "ours.startup.weights_read_s")
    mib = lookup(results, "ours.startup.mib_read")
    if weights.number is not None and mib is not None:
        detail = f"{mib:.1f} MiB, {lookup(results, 'ours.startup.loaded_on') or '?'}"
        if lookup(results, "ours.startup.capture_logged_first"):
            detail += "; graph capture included: its line came first"
        weights = Value(weights.number, detail=detail)
    ready = measured(results, "ours.startup.ready_s")
    if ready.number is not None and weights.number is not None:
        ready = Value(ready.number, detail=f"{ready.number - weights.number:.1f} s after weights")
    cap = capture(results)
    ok = None if cap.number is None else cap.number < TARGET_CAPTURE_S
    return [
        ("start-up: weights read (after launch)", _fmt(weights, " s"), "", _status(weights, None)),
        ("start-up: CUDA graph capture", _fmt(cap, " s"), "< 60 s", _status(cap, ok)),
        ("start-up: /health ready (after launch)", _fmt(ready, " s"), "", _status(ready, None)),
    ]


def throughput_rows(results: dict[str, Any]) -> list[Row]:
    roof = roofline(results)
    big = ratio(results, "ours.c32.output_tok_s", "hf.b32.tok_s")
    small = ratio(results, "ours.c1.output_tok_s", "hf.b1.tok_s")
    roof_ok = None if roof.number is None else roof.number >= TARGET_ROOFLINE
    big_ok = None if big.number is None else big.number >= TARGET_RATIO_C32
    plain = [
        ("ours c=1 decode tok/s (1000 / median TPOT)", "ours.c1.decode_tok_s", " tok/s"),
        ("ours c=1 output tok/s", "ours.c1.output_tok_s", " tok/s"),
        ("ours c=1 TTFT median", "ours.c1.ttft_ms_p50", " ms"),
        ("ours c=32 output tok/s", "ours.c32.output_tok_s", " tok/s"),
        ("ours c=32 TTFT median", "ours.c32.ttft_ms_p50", " ms"),
        ("HF generate() batch 1 tok/s", "hf.b1.tok_s", " tok/s"),
        ("HF generate() batch 32 tok/s", "hf.b32.tok_s", " tok/s"),
    ]
    out: list[Row] = []
    for name, path, unit in plain:
        value = measured(results, path)
        out.append((name, _fmt(value, unit), "", _status(value, None)))
    out.insert(
        1,
        (
            "ours c=1 % of HBM roofline",
            _fmt(roof, " %", 1, 100.0),
            "≥ 75 %",
            _status(roof, roof_ok),
        ),
    )
    out.append(("ours c=32 / HF batch 32", _fmt(big, "×", 2), "≥ 5×", _status(big, big_ok)))
    out.append(("ours c=1 / HF batch 1", _fmt(small, "×", 2), "", _status(small, None)))
    return out


def rows(results: dict[str, Any]) -> list[Row]:
    return [
        *parity_rows(results),
        *startup_rows(results),
        *throughput_rows(results),
        *quant_report.rows(results),
        *device_rows(results),
    ]


def header(results: dict[str, Any]) -> list[str]:
    d, s, m = results.get("device", {}), results.get("settings", {}), results.get("model", {})
    peak = results.get("peak_bw")
    source = results.get("peak_bw_source")
    bw = f"peak memory bandwidth {_si(peak)}B/s ({source})" if peak else "peak bandwidth unknown"
    shape = m.get("shape", {})
    return [
        f"# make gpu-check ({results.get('mode', '?')})",
        "",
        f"- device: {d.get('name', '?')}; {bw}",
        f"- torch {d.get('torch')} (CUDA {d.get('cuda')}), triton {d.get('triton')}, "
        f"transformers {d.get('transformers')}, Python {d.get('python')}",
        f"- date: {d.get('date')}; whole run {results.get('wall_s', 0):.0f} s "
        f"(budget {s.get('timeout_s', 0):.0f} s)",
        *budget_lines(results),
        f"- model: random Llama, shape {s.get('shape_name')} "
        f"({_si(shape.get('parameters', 0))} parameters, {s.get('dtype')}), "
        f"{_si(m.get('bytes_per_token', 0))}B read per batch-1 decode step",
        f"- workload: {s.get('prompt_len')}-token prompts, greedy, EOS ignored; "
        f"c=1: {s.get('requests_c1')} requests × {s.get('output_c1')} tokens; "
        f"c=32: {s.get('requests_c32')} × {s.get('output_c32')}; HF: one batch each",
        "",
    ]


def budget_lines(results: dict[str, Any]) -> list[str]:
    """The time budget (set-up, timeout, each phase's slot) and what it cut."""
    b = results.get("budget")
    if not isinstance(b, dict):
        return []
    slots = b.get("slots") or {}
    listed = ", ".join(f"{k} {v:.0f}" for k, v in slots.items()) or "none (--smoke)"
    total = b["setup_s"] + b["timeout_s"]
    line = (
        f"- time: set-up {b['setup_s']:.0f} s + --timeout {b['timeout_s']:.0f} s "
        f"({b['reserve_s']:.0f} s of it to stop and report) = {total:.0f} s of the "
        f"{b['wall_s']:.0f} s allowed; phase slots (s, sum {sum(slots.values()):.0f}): {listed}"
    )
    markers = ("cut at", "not started", "not reached")
    cut = [k for k, why in results.get("missing", {}).items() if any(m in why for m in markers)]
    return [line, f"- cut by the budget: {', '.join(cut) if cut else 'nothing'}"]


def render(results: dict[str, Any]) -> str:
    lines = header(results)
    lines += ["| check | value | target | status |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows(results)]
    lines += sections(results)
    notes = [n.strip().splitlines()[0] for n in results.get("notes", [])]
    if notes:
        lines += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """``gpu-check.json`` and ``gpu-check.md`` into ``out_dir``; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu-check.json", out_dir / "gpu-check.md"
    json_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    md_path.write_text(render(results))
    return json_path, md_path
