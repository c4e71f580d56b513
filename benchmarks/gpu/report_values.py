"""The report's values: a number or why it is missing, looked up in the results dict, and
how each is printed. Shared by :mod:`.report` and :mod:`.report_step`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Row = tuple[str, str, str, str]  # check, value, target, status


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


def ratio(results: dict[str, Any], num: str, den: str) -> Value:
    a, b = measured(results, num), measured(results, den)
    if a.number is None or b.number is None or b.number == 0:
        lacking = num if a.number is None else den
        return Value(None, f"needs {lacking} ({(a if a.number is None else b).why})")
    return Value(a.number / b.number, detail=f"{a.number:.1f} / {b.number:.1f} tok/s")


def si(n: float) -> str:
    """``8.03 G``, ``336.19 k``: three significant-ish digits with an SI prefix."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}"
    return f"{n:.0f} "


def fmt(value: Value, unit: str, digits: int = 1, scale: float = 1.0) -> str:
    if value.number is None:
        return f"missing: {value.why}"
    text = f"{value.number * scale:.{digits}f}{unit}"
    return f"{text} ({value.detail})" if value.detail else text


def status(value: Value, ok: bool | None) -> str:
    if value.number is None:
        return "missing"
    return "" if ok is None else ("met" if ok else "not met")
