"""The report's rows for the tests on the device, the step breakdown and the ceiling, and
its two tables (``F.linear`` against the copy, the profiler's top kernels).

Targets (issue 43): our c=1 decode ≥ 90 % of the compiled ceiling at batch 1 and its
bytes ≥ 80 % of the measured copy bandwidth; our c=32 output ≥ the ceiling at batch 32;
families: graph replay = eager (greedy tokens), logits within 5e-2 of the reference
(bfloat16); every test run passes.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.parity import PARITY_RUNS, parity_ok
from benchmarks.gpu.report_values import Row, Value, fmt, lookup, measured, ratio, reason, status

TARGET_OF_CEILING_B1 = 0.90
TARGET_OF_COPY_B1 = 0.80
TARGET_OF_CEILING_B32 = 1.0
FAMILY_LOGITS_RTOL = 5e-2


def parity_rows(results: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for r in PARITY_RUNS:
        name = f"{r.title} on {lookup(results, 'settings.device')}"
        run = lookup(results, f"parity.{r.key}")
        if not isinstance(run, dict):
            out.append(
                (name, f"missing: {reason(results, f'parity.{r.key}')}", "all pass", "missing")
            )
            continue
        c = run["counts"]
        text = (
            f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
            f"{c['skipped']} skipped in {c['seconds']:.1f} s"
        )
        if run.get("timed_out"):
            text += f" (cut at the {run['cap_s']:.0f} s cap)"
        out.append((name, text, "all pass", "met" if parity_ok(run) else "not met"))
    return out


def family_row(results: dict[str, Any]) -> Row:
    name = "families at tp=1: logits vs reference backend, graph replays = eager"
    target = f"rel err < {FAMILY_LOGITS_RTOL:g}; tokens equal"
    families: dict[str, dict[str, Any]] = results.get("graph_parity") or {}
    if not families:
        return (name, f"missing: {reason(results, 'graph_parity')}", target, "missing")
    failed = sorted(n for n, f in families.items() if "error" in f)
    done = {n: f for n, f in families.items() if "error" not in f}
    bad = sorted(
        n
        for n, f in done.items()
        if not f["graph_tokens_equal_eager"]
        or not f.get("piecewise_tokens_equal_eager", True)
        or f["logits_rel_err"] >= FAMILY_LOGITS_RTOL
    )
    worst = max((f["logits_rel_err"] for f in done.values()), default=float("nan"))
    graphed = sum(bool(f["graphed"]) for f in done.values())
    pieced = sum(bool(f.get("piecewise")) for f in done.values())
    same = sum(bool(f["tokens_equal_reference"]) for f in done.values())
    text = (
        f"{len(done)} families, {graphed} graphed ({pieced} piecewise too); worst rel err "
        f"{worst:.2e}; greedy = "
        f"reference in {same}/{len(done)}"
    )
    if bad:
        text += f"; off: {', '.join(bad)}"
    if failed:
        text += f"; errors: {', '.join(failed)}"
    return (name, text, target, "not met" if bad or failed else "met")


def share(part: Value, whole: Value, what: str) -> Value:
    if part.number is None or whole.number is None or whole.number == 0:
        return Value(None, f"needs {what} ({part.why or whole.why})")
    return Value(part.number / whole.number)


def step_rows(results: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    copy = measured(results, "step.copy.gb_s")
    out.append(("device-to-device copy bandwidth", fmt(copy, " GB/s"), "", status(copy, None)))
    for b in ("b1", "b32"):
        engine, replay = (
            measured(results, f"step.{b}.engine_ms"),
            measured(results, f"step.{b}.replay_ms"),
        )
        gap = measured(results, f"step.{b}.host_gap_ms")
        if engine.number is not None and replay.number is None:
            replay = gap = Value(None, "no decode graph holds this step: it ran eagerly")
        if gap.number is not None and engine.number:
            gap = Value(gap.number, detail=f"{100 * gap.number / engine.number:.0f} % of the step")
        n = b[1:]
        out += [
            _ms_row(f"engine step, batch {n} (median)", engine),
            _ms_row(f"its decode graph's replay alone, batch {n}", replay),
            _ms_row(f"host gap (step − replay), batch {n}", gap),
            _ms_row(f"engine step, async scheduling, batch {n}", _at(results, b, "async_ms")),
            _ms_row(
                f"host gap left under async scheduling, batch {n}", _at(results, b, "async_gap_ms")
            ),
        ]
    return out


def mixed_rows(results: dict[str, Any]) -> list[Row]:
    """A prefill beside decodes: eager against piecewise graphs (no target: measured first)."""
    mixed = lookup(results, "step.mixed")
    eager, pieces = (
        measured(results, "step.mixed.eager_ms"),
        measured(results, "step.mixed.piecewise_ms"),
    )
    what = "mixed step"
    if isinstance(mixed, dict):
        what = f"mixed step ({mixed['prefill']}-token prefill + {mixed['decodes']} decodes)"
        if eager.number is not None and pieces.number is None:
            pieces = Value(None, "no piecewise graphs (the stack does not cut, or no graphs)")
        elif pieces.number is not None and eager.number:
            detail = f"bucket {mixed['bucket']}; {eager.number / pieces.number:.2f}× eager's speed"
            pieces = Value(pieces.number, detail=detail)
    return [
        (f"{what}, eager", fmt(eager, " ms", 2), "", status(eager, None)),
        (f"{what}, piecewise graphs", fmt(pieces, " ms", 2), "", status(pieces, None)),
    ]


def ceiling_rows(results: dict[str, Any]) -> list[Row]:
    b1, b32 = measured(results, "ceiling.b1.tok_s"), measured(results, "ceiling.b32.tok_s")
    of_b1 = ratio(results, "ours.c1.decode_tok_s", "ceiling.b1.tok_s")
    of_b32 = ratio(results, "ours.c32.output_tok_s", "ceiling.b32.tok_s")
    copy = copy_fraction(results)
    targets: list[tuple[Value, float]] = [(of_b1, TARGET_OF_CEILING_B1)]
    targets += [(copy, TARGET_OF_COPY_B1), (of_b32, TARGET_OF_CEILING_B32)]
    ok = [None if v.number is None else v.number >= t for v, t in targets]
    return [
        ("compiled plain PyTorch ceiling, batch 1", fmt(b1, " tok/s"), "", status(b1, None)),
        ("compiled plain PyTorch ceiling, batch 32", fmt(b32, " tok/s"), "", status(b32, None)),
        (
            "ours c=1 decode / ceiling batch 1",
            fmt(of_b1, " %", 1, 100.0),
            "≥ 90 %",
            status(of_b1, ok[0]),
        ),
        (
            "ours c=1 decode bytes/s / measured copy",
            fmt(copy, " %", 1, 100.0),
            "≥ 80 %",
            status(copy, ok[1]),
        ),
        ("ours c=32 output / ceiling batch 32", fmt(of_b32, "×", 2), "≥ 1×", status(of_b32, ok[2])),
    ]


def copy_fraction(results: dict[str, Any]) -> Value:
    """Our c=1 decode rate × bytes per token over the copy's measured bandwidth."""
    tok_s, copy = measured(results, "ours.c1.decode_tok_s"), measured(results, "step.copy.gb_s")
    per_token = lookup(results, "model.bytes_per_token")
    if tok_s.number is None or copy.number is None or not per_token:
        lacking = "ours c=1 decode tok/s" if tok_s.number is None else "the copy bandwidth"
        return Value(None, f"needs {lacking} ({tok_s.why or copy.why or 'no bytes/token'})")
    rate = tok_s.number * float(per_token) / 1e9
    return Value(rate / copy.number, detail=f"{rate:.0f} / {copy.number:.0f} GB/s")


def device_rows(results: dict[str, Any]) -> list[Row]:
    return [family_row(results), *step_rows(results), *mixed_rows(results), *ceiling_rows(results)]


def sections(results: dict[str, Any]) -> list[str]:
    """Markdown: the ``F.linear`` table, the fusions' and the kernel table, where measured."""
    lines: list[str] = []
    linear = lookup(results, "step.linear.rows")
    if linear:
        lines += ["", "## F.linear against the copy bandwidth", ""]
        lines += ["| matrix | M | [out, in] | ms | GB/s | % of copy |", "|---|---|---|---|---|---|"]
        for r in linear:
            pct = "" if r.get("copy_pct") is None else f"{r['copy_pct']:.0f} %"
            lines.append(
                f"| {r['matrix']} | {r['m']} | {r['shape']} | {r['ms']:.4f} | "
                f"{r['gb_s']:.0f} | {pct} |"
            )
    lines += fusion_section(results)
    kernels = lookup(results, "step.kernels")
    if isinstance(kernels, dict) and kernels.get("rows"):
        lines += [
            "",
            f"## Top kernels, batch {kernels['batch']} decode ({kernels['steps']} steps)",
            "",
            f"{kernels.get('launches_per_step', 0):.0f} device entries (kernels, copies) and "
            f"{kernels.get('device_us_per_step', 0):.0f} µs of device time a step.",
            "",
            "| kernel | calls/step | µs/step |",
            "|---|---|---|",
        ]
        for r in kernels["rows"]:
            name = str(r["name"]).replace("|", "\\|")[:90]
            lines.append(f"| `{name}` | {r['calls_per_step']:.1f} | {r['per_step_us']:.1f} |")
    return lines


def _ms_row(label: str, value: Value) -> Row:
    """A row of milliseconds, no target."""
    return (label, fmt(value, " ms", 2), "", status(value, None))


def _at(results: dict[str, Any], batch: str, key: str) -> Value:
    """The step phase's ``key`` at ``batch`` (``b1``, ``b32``)."""
    return measured(results, f"step.{batch}.{key}")


def fusion_section(results: dict[str, Any]) -> list[str]:
    """Markdown: each fused kernel against its unfused launches (the step phase's
    ``fusions`` event), or why it was not measured."""
    fusions = lookup(results, "step.fusions")
    if not isinstance(fusions, dict):
        return []
    lines = ["", "## Fused kernels against their unfused launches (CUDA events)", ""]
    if fusions.get("skipped"):
        return [*lines, f"Not measured: {fusions['skipped']}."]
    lines += [
        "| fusion | M | unfused ms | fused ms | saved µs | same bits | max abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in fusions.get("rows", []):
        lines.append(
            f"| {r['fusion']} | {r['m']} | {r['unfused_ms']:.4f} | {r['fused_ms']:.4f} | "
            f"{r['saved_us']:.1f} | {'yes' if r['bitwise'] else 'no'} | {r['max_abs_diff']:.3g} |"
        )
    for name, error in (fusions.get("errors") or {}).items():
        lines.append(f"\n{name}: not measured ({error})")
    return lines
