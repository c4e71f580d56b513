"""The report rows of the gpu-check's FP8 / AWQ runs and SmolLM2 perplexity (``rows``).

Each row is ``(check, value, target, status)`` like :mod:`benchmarks.gpu.report`'s (which
lists these after its own); a number not measured shows ``missing: <reason>`` from
``results["missing"]`` under the longest matching key. Targets, against the bf16 run of the
same invocation (``ours``):

- batch-1 decode tok/s (1000 / median TPOT): FP8 ≥ 1.7×, AWQ ≥ 2.5× bf16's;
- c=32 output tok/s: FP8 ≥ 1.3× bf16's (AWQ's shown, no target);
- SmolLM2 perplexity with ``--quantization fp8`` ≤ bf16's + 1 %.

% of HBM roofline: decode tok/s × the format's ``bytes_per_token`` (weights as stored, see
:mod:`benchmarks.gpu.quant_runs`) over ``results["peak_bw"]``; no target of its own.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.report_values import lookup, reason
from benchmarks.gpu.shapes import roofline_fraction

NAMES = {"fp8": "FP8", "awq": "AWQ"}
TARGETS: dict[tuple[str, str], float] = {
    ("fp8", "c1"): 1.7,
    ("awq", "c1"): 2.5,
    ("fp8", "c32"): 1.3,
}
PPL_MAX_RATIO = 1.01
Row = tuple[str, str, str, str]
Found = tuple[float | None, str]  # the number, or None and why


def _number(results: dict[str, Any], path: str) -> Found:
    value = lookup(results, path)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value), ""
    return None, reason(results, path)


def _row(name: str, found: Found, text: str, target: str = "", ok: bool | None = None) -> Row:
    """``text`` formats the number; status from ``ok`` (``None``: no target)."""
    if found[0] is None:
        return (name, f"missing: {found[1]}", target, "missing")
    return (name, text, target, "" if ok is None else ("met" if ok else "not met"))


def _ratio(results: dict[str, Any], num: str, den: str, digits: int = 1) -> tuple[Found, str]:
    (a, why_a), (b, why_b) = _number(results, num), _number(results, den)
    if a is None or b is None or b == 0:
        lacking, why = (num, why_a) if a is None else (den, why_b)
        return (None, f"needs {lacking} ({why})"), ""
    return (a / b, ""), f"{a:.{digits}f} / {b:.{digits}f}"


def format_rows(results: dict[str, Any], fmt: str) -> list[Row]:
    """One format's c=1 decode rate, its roofline %, c=32 throughput, and both against bf16."""
    name, base = NAMES[fmt], f"quant.{fmt}"
    decode = _number(results, f"{base}.c1.decode_tok_s")
    c32 = _number(results, f"{base}.c32.output_tok_s")
    return [
        _row(
            f"{name} c=1 decode tok/s", decode, f"{decode[0] or 0:.1f} tok/s (1000 / median TPOT)"
        ),
        roofline_row(results, fmt, decode),
        vs_bf16(results, fmt, "c1", "decode_tok_s", f"{name} c=1 decode / bf16 c=1 decode"),
        _row(f"{name} c=32 output tok/s", c32, f"{c32[0] or 0:.1f} tok/s"),
        vs_bf16(results, fmt, "c32", "output_tok_s", f"{name} c=32 / bf16 c=32"),
    ]


def vs_bf16(results: dict[str, Any], fmt: str, point: str, field: str, name: str) -> Row:
    """``quant.<fmt>.<point>.<field>`` over ``ours.<point>.<field>``, with its target."""
    found, detail = _ratio(results, f"quant.{fmt}.{point}.{field}", f"ours.{point}.{field}")
    target = TARGETS.get((fmt, point))
    ok = None if target is None or found[0] is None else found[0] >= target
    text = f"{found[0] or 0:.2f}× ({detail} tok/s)"
    return _row(name, found, text, f"≥ {target}×" if target else "", ok)


def roofline_row(results: dict[str, Any], fmt: str, decode: Found) -> Row:
    name = f"{NAMES[fmt]} c=1 % of HBM roofline"
    bytes_per_token = lookup(results, f"quant.{fmt}.bytes_per_token")
    peak = results.get("peak_bw")
    if decode[0] is None:
        return _row(name, (None, f"needs {fmt} c=1 decode tok/s ({decode[1]})"), "")
    if not peak or not bytes_per_token:
        return _row(name, (None, "no peak bandwidth known for this device: pass --peak-bw"), "")
    frac = roofline_fraction(decode[0], float(bytes_per_token), float(peak))
    detail = f"{decode[0]:.1f} tok/s × {bytes_per_token / 1e9:.2f} GB / {peak / 1e12:.2f} TB/s"
    return _row(name, (frac, ""), f"{100 * frac:.1f} % ({detail})")


def perplexity_rows(results: dict[str, Any]) -> list[Row]:
    device = lookup(results, "settings.device")
    out = []
    for label, flag in (("bf16", "bfloat16"), ("fp8", "--quantization fp8")):
        found = _number(results, f"perplexity.{label}.ppl")
        tokens = lookup(results, f"perplexity.{label}.tokens")
        text = f"{found[0] or 0:.4f} ({tokens} tokens)"
        out.append(_row(f"SmolLM2 perplexity, {flag} on {device}", found, text))
    found, detail = _ratio(results, "perplexity.fp8.ppl", "perplexity.bf16.ppl", 4)
    ok = None if found[0] is None else found[0] <= PPL_MAX_RATIO
    change = 100 * ((found[0] or 1.0) - 1.0)
    text = f"{change:+.2f} % ({detail.replace(' / ', ' vs ')})"
    out.append(_row("SmolLM2 perplexity, FP8 vs bf16", found, text, "≤ +1 %", ok))
    return out


def rows(results: dict[str, Any]) -> list[Row]:
    return [*format_rows(results, "fp8"), *format_rows(results, "awq"), *perplexity_rows(results)]
