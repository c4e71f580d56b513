"""``make bench``: shardserve vs ``transformers serve`` vs padded ``generate()`` on CPU.

Run as ``python -m benchmarks [flags]``: every suite in turn, then ``results/latest.json`` and
``README.md`` (:mod:`benchmarks.readme`). Builds the random ~135M Llama once
(:mod:`benchmarks.harness.model`) and measures this machine's roofline; then the TTFT
breakdown (:mod:`benchmarks.suites.ttft`, first: the machine is at its quietest), the
throughput tables (:mod:`benchmarks.suites.throughput`: every concurrency and dtype, tp/pp
layouts, the Qwen3-shaped family), the MoE, quantized-checkpoint (FP8, AWQ), structured-output,
multi-LoRA and vision rows, and last the
contention table (:mod:`benchmarks.suites.contention`) and the real SmolLM2 model against
llama.cpp (:mod:`benchmarks.suites.llamacpp_peer`, which builds llama.cpp on its first run),
and n-gram speculative decoding against none (:mod:`benchmarks.suites.spec_decode`);
``--no-<suite>`` skips one. Every
server runs in its own process group and is stopped in a ``finally``; an interrupted run
still writes what it measured.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks import readme
from benchmarks.harness import servers
from benchmarks.harness.bench import (
    OUTPUT_LEN,
    PARALLEL_CONCURRENCY,
    POINT_CAP_S,
    PROMPT_LEN,
    Bench,
    num_requests,
)
from benchmarks.harness.machine import machine, measure_roofline
from benchmarks.harness.model import SHAPES, ensure_model
from benchmarks.harness.paths import BENCH_DIR, RESULTS
from benchmarks.suites import (
    contention,
    llamacpp_peer,
    lora_bench,
    moe_bench,
    quant_bench,
    spec_decode,
    structured,
    throughput,
    ttft,
)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=(__doc__ or "").splitlines()[0]
    )
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--systems", default="shardserve,hf-serve,hf-generate")
    suites: tuple[str, ...] = ("parallel", "families", "moe", "quant", "structured", "lora")
    suites += ("vlm", "contention", "llamacpp", "spec", "ttft")
    for suite in suites:
        p.add_argument(f"--no-{suite}", dest=suite, action="store_false")
    p.add_argument("--out", default=str(RESULTS / "latest.json"))
    p.add_argument("--readme", default=str(BENCH_DIR / "README.md"), help="'' to skip")
    return p


def result_json(bench: Bench, roofline: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """What ``latest.json`` holds: the machine, the settings, the model, every row and note."""
    shape = SHAPES["main"]
    return {
        "machine": machine(),
        "command": "make bench",
        "settings": {
            "prompt_len": PROMPT_LEN,
            "output_len": OUTPUT_LEN,
            "requests": {str(c): num_requests(c) for c in bench.concurrencies},
            "point_cap_s": POINT_CAP_S,
        },
        "model": {
            "parameters": shape.total_params(),
            "matmul_parameters": shape.matmul_params(),
            "flops_per_output_token": shape.flops_per_output_token(PROMPT_LEN, OUTPUT_LEN),
        },
        "roofline": roofline,
        "rows": bench.rows,
        "notes": bench.notes,
        "wall_s": wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    started = time.monotonic()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if (args.parallel or args.families or args.moe) and PARALLEL_CONCURRENCY not in concurrencies:
        concurrencies.append(PARALLEL_CONCURRENCY)
    dtypes, systems = args.dtypes.split(","), args.systems.split(",")
    print("building the model and measuring the roofline ...", flush=True)
    bench = Bench(concurrencies)
    ensure_model("tp2")
    roofline = measure_roofline()
    print(f"  roofline: {roofline}", flush=True)
    try:
        if args.ttft:  # first: the machine is at its quietest
            ttft.run_ttft(bench, tuple(dtypes))
        for dtype in dtypes:
            throughput.sweep(bench, dtype, systems)
        if args.parallel:
            throughput.run_parallel(bench, servers.ours_flags())
        if args.families:
            throughput.run_families(bench)
        if args.moe:
            moe_bench.run_moe(bench, PARALLEL_CONCURRENCY)
        if args.quant:
            quant_bench.run_quant(bench)
        if args.structured:
            structured.run_structured(bench, PARALLEL_CONCURRENCY)
        if args.lora:
            lora_bench.run_lora(bench, PARALLEL_CONCURRENCY)
        if args.vlm:
            from benchmarks.suites import vlm_bench  # LLaVA and Qwen2.5-VL images (own models)

            vlm_bench.run_vlm(bench)
        if args.contention:
            contention.run_contention(bench)
        if args.llamacpp:
            try:
                llamacpp_peer.run_peer(bench)
            except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
                first = (str(err).splitlines() or [type(err).__name__])[0]
                bench.notes.append(f"llama.cpp rows not measured: {first}")
        if args.spec:
            spec_decode.run_spec(bench)
    except KeyboardInterrupt:
        print("interrupted: every server was stopped; writing what was measured", flush=True)
        bench.notes.append("run interrupted before the end")
    result = result_json(bench, roofline, time.monotonic() - started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(readme.render(result))
    if args.readme:
        readme.write_readme(result, Path(args.readme))
    return 0
