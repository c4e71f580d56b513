"""The one entry point of the benchmarks (modules are imported only when run)::

    python -m benchmarks [FLAGS]              make bench: every suite, then results and README
    python -m benchmarks gpu-check [FLAGS]    make gpu-check (--smoke: a tiny Llama on CPU)
    python -m benchmarks suites NAME [ARGS]   one suite's rows alone
    python -m benchmarks micro NAME [ARGS]    a kernel or engine-step micro-benchmark
    python -m benchmarks harness NAME [ARGS]  a helper the suites start as a subprocess
    python -m benchmarks gpu NAME [ARGS]      a helper the GPU check starts as a subprocess

Each NAME is a module of that folder with a ``main(argv)``; ``NAME --help`` lists its flags.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, ...]] = {
    "suites": (
        "ttft",
        "moe_bench",
        "quant_bench",
        "structured",
        "lora_bench",
        "vlm_bench",
        "contention",
        "contention_ab",
        "llamacpp_peer",
        "spec_decode",
        "perplexity",
    ),
    "micro": (
        "decode_attention",
        "prefill_attention",
        "prefill_gemm",
        "prefill_profile",
        "quant_gemm",
        "decode_step",
        "sched_share",
        "spec_steps",
    ),
    "harness": ("roofline", "hf_generate", "gguf_dequantize", "quantize_checkpoint"),
    "gpu": (
        "build_model",
        "hf_bench",
        "quant_checkpoints",
        "smollm2_dense",
        "ceiling",
        "step_breakdown",
        "graph_parity",
    ),
}


def usage() -> str:
    names = "\n".join(f"  {group}: {', '.join(names)}" for group, names in COMMANDS.items())
    return f"{(__doc__ or '').strip()}\n\nNAMEs:\n{names}"


def resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    """The module to run and its arguments; ``None``: an unknown command or name."""
    if argv[:1] == ["gpu-check"]:
        return "benchmarks.gpu.check", argv[1:]
    if argv[:1] and argv[0] in COMMANDS:
        name = argv[1].replace("-", "_") if len(argv) > 1 else ""
        if name not in COMMANDS[argv[0]]:
            return None
        return f"benchmarks.{argv[0]}.{name}", argv[2:]
    return "benchmarks.make_bench", argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        from benchmarks import make_bench

        print(usage() + "\n\nmake bench's flags:\n" + make_bench.parser().format_help())
        return 0
    target = resolve(argv)
    if target is None:
        print(usage(), file=sys.stderr)
        return 2
    module, rest = target
    sys.argv[0] = " ".join(["python -m benchmarks", *argv[: len(argv) - len(rest)]])  # --help
    return int(importlib.import_module(module).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
