"""The quantized-checkpoint rows of ``make bench``: the bench model (``main``, ~135M Llama) as
stored (dense), as a compressed-tensors FP8 checkpoint and as an AWQ checkpoint (4-bit, groups
of 64: 576 inputs are not whole groups of 128), all served in bfloat16 on CPU.

The quantized checkpoints are written once into ``benchmarks/.cache`` by
:mod:`benchmarks.harness.quantize_checkpoint`. On CPU the FP8 weights are dequantized at load
(W8A16 in bfloat16: the dense model's GEMMs) and the AWQ groups become Q4_1 blocks for the
quantized-block kernels (int8 activations). The three servers are up at once and measured
in turn at concurrency 1 and 32 (one round each, the order reversed at 32), the same prompts
and load as the other tables.

``python -m benchmarks suites quant_bench --out /tmp/quant.json`` runs these rows alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

from benchmarks.harness import servers
from benchmarks.harness.bench import Bench, Target
from benchmarks.harness.machine import machine
from benchmarks.harness.model import VERSION as MODEL_VERSION
from benchmarks.harness.model import ensure_checkpoint, ensure_model
from benchmarks.harness.paths import CACHE
from benchmarks.harness.quantize_checkpoint import write_quantized
from benchmarks.harness.tables import ratio, tok_cell

VERSION = "v1"  # bump when the quantizer's bytes change
DTYPE = "bfloat16"
CONCURRENCIES = (1, 32)
GROUP_SIZE = 64
LAYOUTS = {
    "dense": "bench model, dense",
    "fp8": "bench model, FP8 (compressed-tensors)",
    "awq": f"bench model, AWQ (4-bit, group {GROUP_SIZE})",
}


def ensure_quantized(fmt: str) -> Path:
    """The bench model in ``fmt`` (``dense``: as built), written first if missing."""
    dense = ensure_model("main")
    if fmt == "dense":
        return dense

    def write(path: Path) -> None:
        write_quantized(dense, path, fmt, GROUP_SIZE)

    return ensure_checkpoint(CACHE / f"llama135m-main-{MODEL_VERSION}-{fmt}-{VERSION}", write)


def _start(stack: contextlib.ExitStack, fmt: str) -> Target:
    log = CACHE / "logs" / f"shardserve-quant-{fmt}.log"
    command = servers.ours_command(ensure_quantized(fmt), DTYPE, [])
    return ("shardserve", stack.enter_context(servers.running(command, log)), "")


def run_quant(bench: Bench) -> None:
    """The rows of the module docstring (every server stopped on exit)."""
    missing = [c for c in CONCURRENCIES if c not in bench.concurrencies]
    if missing:
        bench.notes.append(f"quantized checkpoints: concurrency {missing} not in this run")
    with contextlib.ExitStack() as stack:
        targets = [(_start(stack, fmt), layout) for fmt, layout in LAYOUTS.items()]
        for target, _ in targets:
            bench.http_point(target, DTYPE, None, "")
        for i, c in enumerate(c for c in CONCURRENCIES if c in bench.concurrencies):
            for target, layout in targets if i % 2 == 0 else targets[::-1]:
                bench.http_point(target, DTYPE, c, layout)


def quant_table(result: dict[str, Any]) -> str:
    """Each checkpoint's throughput at each concurrency, and against the dense one."""
    rows = [r for r in result["rows"] if r["layout"] in LAYOUTS.values()]
    if not rows:
        return "(not measured)"
    tok = {(r["layout"], r["concurrency"]): float(r["output_throughput"]) for r in rows}
    lines = [
        "| checkpoint (bfloat16, CPU) | concurrency | output tok/s | vs dense |",
        "|---|---:|---:|---:|",
    ]
    for r in sorted(
        rows, key=lambda r: (r["concurrency"], list(LAYOUTS.values()).index(r["layout"]))
    ):
        dense = tok.get((LAYOUTS["dense"], r["concurrency"]))
        vs = (
            ""
            if r["layout"] == LAYOUTS["dense"]
            else ratio(tok[(r["layout"], r["concurrency"])], dense)
        )
        lines.append(f"| {r['layout']} | {r['concurrency']} | {tok_cell(r)} | {vs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """These rows alone, written to ``--out``."""
    parser = argparse.ArgumentParser(description="the quantized-checkpoint rows of make bench")
    parser.add_argument("--out", default="/tmp/quant-bench.json")
    args = parser.parse_args(argv)
    bench = Bench(list(CONCURRENCIES))
    run_quant(bench)
    result = {"machine": machine(), "rows": bench.rows, "notes": bench.notes}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(quant_table(result))
    print("\n".join(f"- {n}" for n in bench.notes))
    return 0
