"""Turn ``results/latest.json`` into the printed tables and ``benchmarks/README.md``.

Each suite renders its own table; this puts them together (and is imported by none of them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.paths import BENCH_DIR
from benchmarks.suites import (
    contention_table,
    llamacpp_table,
    lora_bench,
    moe_bench,
    quant_bench,
    spec_decode,
    structured,
    throughput,
    ttft,
)


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


def tables(result: dict[str, Any]) -> dict[str, str]:
    """Every table's markdown by its field in ``README.template.md``, in the README's order."""
    return {
        "main_table": throughput.main_table(result),
        "ttft_table": ttft.ttft_table(result),
        "parallel_table": throughput.parallel_table(result),
        "family_table": throughput.family_table(result),
        "moe_table": moe_bench.moe_table(result),
        "quant_table": quant_bench.quant_table(result),
        "structured_table": structured.structured_table(result),
        "lora_table": lora_bench.lora_table(result),
        "contention_table": contention_table.contention_table(result),
        "llamacpp_table": llamacpp_table.peer_table(result),
        "spec_table": spec_decode.spec_table(result),
        "roofline": roofline_text(result),
    }


def _notes(result: dict[str, Any]) -> str:
    return "\n".join(f"- {n}" for n in result["notes"]) or "- none"


def render(result: dict[str, Any]) -> str:
    return "\n\n".join([*tables(result).values(), "Notes:\n" + _notes(result)])


def write_readme(result: dict[str, Any], path: Path) -> None:
    template = (BENCH_DIR / "README.template.md").read_text()
    m = result["machine"]
    machine = (
        f"{m['cpu']}, {m['cores_usable']} usable cores (os.cpu_count {m['cores']}), "
        f"torch {m['torch']}, transformers {m['transformers']}, "
        f"Python {m['python']}, {m['date']}; whole run {result['wall_s'] / 60:.1f} min"
    )
    fields = {"machine": machine, **tables(result), "notes": _notes(result)}
    text = template
    for key, value in fields.items():  # not str.format: the template has JSON braces
        text = text.replace("{" + key + "}", value)
    path.write_text(text)
