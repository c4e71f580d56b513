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
- parity: every test run passes, none fails or errors, within the time cap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu import quant_report
from benchmarks.gpu.parity import parity_ok
from benchmarks.gpu.shapes import roofline_fraction

TARGET_ROOFLINE = 0.75
TARGET_RATIO_C32 = 5.0
TARGET_CAPTURE_S = 60.0
Row = tuple[str, str, str, str]


@dataclass(frozen=True, slots=True)
class Value:
    number: float | None
    why: str = ""  # the reason it is missing
    detail: str = ""


def lookup(results: dict[str, Any], path: str) -> Any:
    """``results["a"]["b"]`` for ``"a.b"``; ``None`` where any step is absent."""
    node: Any = results
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def reason(results: dict[str, Any], path: str) -> str:
    """Why ``path`` has no number: the longest recorded prefix's reason, first line."""
    missing: dict[str, str] = results.get("missing") or {}
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        why = missing.get(".".join(parts[:n]))
        if why:
            return why.strip().splitlines()[0]
    return "not measured"


def measured(results: dict[str, Any], path: str) -> Value:
    number = lookup(results, path)
    if isinstance(number, int | float) and not isinstance(number, bool):
        return Value(float(number))
    return Value(None, reason(results, path))


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


def ratio(results: dict[str, Any], num: str, den: str) -> Value:
    a, b = measured(results, num), measured(results, den)
    if a.number is None or b.number is None or b.number == 0:
        lacking = num if a.number is None else den
        return Value(None, f"needs {lacking} ({(a if a.number is None else b).why})")
    return Value(a.number / b.number, detail=f"{a.number:.1f} / {b.number:.1f} tok/s")


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


def _si(n: float) -> str:
    """``8.03 G``, ``336.19 k``: three significant-ish digits with an SI prefix."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}"
    return f"{n:.0f} "


def _fmt(value: Value, unit: str, digits: int = 1, scale: float = 1.0) -> str:
    if value.number is None:
        return f"missing: {value.why}"
    text = f"{value.number * scale:.{digits}f}{unit}"
    return f"{text} ({value.detail})" if value.detail else text


def _status(value: Value, ok: bool | None) -> str:
    if value.number is None:
        return "missing"
    return "" if ok is None else ("met" if ok else "not met")


def parity_row(results: dict[str, Any], dtype: str) -> Row:
    name = f"parity tests, {dtype} on {lookup(results, 'settings.device')}"
    run = lookup(results, f"parity.{dtype}")
    if not isinstance(run, dict):
        return (name, f"missing: {reason(results, f'parity.{dtype}')}", "all pass", "missing")
    c = run["counts"]
    text = (
        f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
        f"{c['skipped']} skipped in {c['seconds']:.1f} s"
    )
    if run.get("timed_out"):
        text += f" (cut at the {run['cap_s']:.0f} s cap)"
    return (name, text, "all pass", "met" if parity_ok(run) else "not met")


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
        parity_row(results, "bfloat16"),
        parity_row(results, "float32"),
        *startup_rows(results),
        *throughput_rows(results),
        *quant_report.rows(results),
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
        f"- model: random Llama, shape {s.get('shape_name')} "
        f"({_si(shape.get('parameters', 0))} parameters, {s.get('dtype')}), "
        f"{_si(m.get('bytes_per_token', 0))}B read per batch-1 decode step",
        f"- workload: {s.get('prompt_len')}-token prompts, greedy, EOS ignored; "
        f"c=1: {s.get('requests_c1')} requests × {s.get('output_c1')} tokens; "
        f"c=32: {s.get('requests_c32')} × {s.get('output_c32')}; HF: one batch each",
        "",
    ]


def render(results: dict[str, Any]) -> str:
    lines = header(results)
    lines += ["| check | value | target | status |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows(results)]
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
