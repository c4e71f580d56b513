"""``make bench``: shardserve vs ``transformers serve`` vs padded ``generate()`` on CPU.

Builds the random ~135M Llama once (:mod:`benchmarks.model`), measures this machine's
roofline (:mod:`benchmarks.roofline`), then output tokens/s for 32-token prompts and
64 greedy output tokens at several concurrencies and dtypes, for:

- ``shardserve``: ``shardserve serve`` subprocess, HTTP load from ``deploy/loadtest.py``;
- ``hf-serve``: ``transformers serve --continuous-batching``, the same HTTP load;
- ``hf-generate``: in-process padded-batch ``generate()``, batch = concurrency.

Then, at concurrency 32 in float32, shardserve's tp=2 vs tp=1 and pp=2 overlapped vs
not; last the contention table (:mod:`benchmarks.contention`, ``--no-contention`` skips
it). Writes ``benchmarks/results/latest.json`` and ``benchmarks/README.md``. Every
server runs in its own process group and is stopped in a ``finally``. Every point waits
until the servers that are up are idle (:mod:`benchmarks.quiesce`): one still computing
requests cancelled at the previous point's cap would share the cores with this one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from tokenizers import Tokenizer

from benchmarks import contention, http_load, moe_bench, quiesce, report, servers, structured, ttft
from benchmarks.model import SHAPES, Variant, ensure_model
from benchmarks.prompts import exact_prompts, write_dataset

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
PROMPT_LEN, OUTPUT_LEN = 32, 64
PARALLEL_CONCURRENCY = 32
# The concurrency the targets are read at: each system runs it this many times, on fresh
# prompts, alternating, and the table reports the median (hf-serve alone has measured
# anywhere from 105 to 136 tok/s in float32 across runs on one machine).
TARGET_CONCURRENCY, TARGET_REPEATS = 32, 5
POINT_CAP_S = 60.0  # a point running longer is cut short (and reported as such)
REQUEST_TIMEOUT_S = 300.0
HELPER_TIMEOUT_S = 300.0


def num_requests(concurrency: int) -> int:
    """Two full waves per point, at least 4 requests."""
    return max(4, 2 * concurrency)


def repeats(concurrency: int) -> int:
    return TARGET_REPEATS if concurrency == TARGET_CONCURRENCY else 1


def dataset_key(concurrency: int, repeat: int) -> str:
    return f"c{concurrency}" if repeat == 0 else f"c{concurrency}-r{repeat + 1}"


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


class Bench:
    """Datasets, logs and results of one run."""

    def __init__(self, concurrencies: list[int]) -> None:
        self.concurrencies = concurrencies
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.model = ensure_model("main")
        tokenizer = Tokenizer.from_file(str(self.model / "tokenizer.json"))
        keys = [(c, r) for c in concurrencies for r in range(repeats(c))]
        total = 2 + sum(num_requests(c) for c, _ in keys)
        prompts = exact_prompts(tokenizer, total, PROMPT_LEN, seed="bench-v1")
        self.prompts: dict[str, list[list[int]]] = {"warmup": prompts[:2]}
        start = 2
        for c, r in keys:  # each point its own prompts: no prefix-cache hits
            self.prompts[dataset_key(c, r)] = prompts[start : start + num_requests(c)]
            start += num_requests(c)
        self.datasets = {
            key: str(write_dataset(tokenizer, ids, OUTPUT_LEN, CACHE / f"data/{key}.jsonl"))
            for key, ids in self.prompts.items()
        }

    def http_point(
        self, target: Target, dtype: str, c: int | None, layout: str, repeat: int = 0
    ) -> None:
        """One load point (``c=None``: the 2-request warm-up, not recorded)."""
        system, url, model = target
        hf_serve = system == "hf-serve"
        key, conc, count = (
            ("warmup", 2, 2) if c is None else (dataset_key(c, repeat), c, num_requests(c))
        )
        quiesce.before_point(self.notes, f"{system} {dtype} {layout} c={conc}")
        load_before = os.getloadavg()[0]
        metrics = http_load.run_point(
            url,
            model,
            self.datasets[key],
            conc,
            count,
            OUTPUT_LEN,
            hf_serve=hf_serve,
            duration_s=POINT_CAP_S,
            timeout_s=REQUEST_TIMEOUT_S,
        )
        if c is not None:
            self.add(system, dtype, c, layout, metrics["streamed_throughput"], metrics, load_before)

    def generate_point(
        self, dtype: str, c: int, model: Path | None = None, layout: str = "batch"
    ) -> None:
        """hf-generate at batch ``c`` (of ``model``, default the bench model), in a fresh
        subprocess (model load not timed)."""
        path = CACHE / "data" / f"generate-c{c}.json"
        spec = {"pad_id": 1, "output_len": OUTPUT_LEN, "prompts": self.prompts[f"c{c}"]}
        path.write_text(json.dumps(spec))
        command = [
            sys.executable,
            "-m",
            "benchmarks.hf_generate",
            str(model or self.model),
            dtype,
            str(path),
            str(POINT_CAP_S),
            f"{c}:{num_requests(c)}",
        ]
        quiesce.before_point(self.notes, f"hf-generate {dtype} {layout} c={c}")
        load_before = os.getloadavg()[0]
        try:
            done = subprocess.run(
                command,
                cwd=servers.REPO,
                capture_output=True,
                text=True,
                timeout=HELPER_TIMEOUT_S,
                check=True,
            )
        except subprocess.TimeoutExpired:
            self.notes.append(f"hf-generate {dtype} c={c}: no result in {HELPER_TIMEOUT_S:g} s")
            return
        m = json.loads(done.stdout.strip().splitlines()[-1])
        if m["requests"] < num_requests(c):
            self.notes.append(
                f"hf-generate {dtype} c={c}: cut at {POINT_CAP_S:g} s after "
                f"{m['requests']} of {num_requests(c)} requests"
            )
        self.add("hf-generate", dtype, c, layout, m["output_throughput"], m, load_before)

    def add(
        self,
        system: str,
        dtype: str,
        c: int,
        layout: str,
        tok_s: float,
        metrics: dict[str, Any],
        load_before: float,
    ) -> None:
        run = {"output_throughput": tok_s, "loadavg_before": load_before, "metrics": metrics}
        report.add_run(self.rows, (system, dtype, c, layout), run)
        errors = metrics.get("errors") or {}
        if errors:
            self.notes.append(
                f"{system} {dtype} {layout} c={c}: requests not completed "
                f"{errors} (cancelled = cut at {POINT_CAP_S:g} s)"
            )
        print(
            f"  {system:12} {dtype:9} {layout:22} c={c:<3} {tok_s:8.1f} tok/s  "
            f"load {load_before:.1f}{'  ' + str(errors) if errors else ''}",
            flush=True,
        )


Target = tuple[str, str, str]
"""(system, base URL, model name; ``""``: the server's first model)."""


def start_ours(
    stack: contextlib.ExitStack,
    dtype: str,
    flags: list[str],
    layout: str,
    variant: Variant = "main",
) -> Target:
    log = CACHE / "logs" / f"shardserve-{dtype}-{layout.replace(' ', '_')}.log"
    command = servers.ours_command(ensure_model(variant), dtype, flags)
    return ("shardserve", stack.enter_context(servers.running(command, log)), "")


def start_hf_serve(stack: contextlib.ExitStack, dtype: str, model: Path) -> Target:
    port = servers.free_port()
    command = servers.hf_serve_command(model, dtype, port)
    log = CACHE / "logs" / f"hf-serve-{dtype}-{model.name}.log"
    env = {"PYTHONPATH": f"{servers.PYDEPS}:{servers.REPO}"}
    url = stack.enter_context(servers.running(command, log, f"http://127.0.0.1:{port}", env))
    return ("hf-serve", url, str(model))


def sweep(bench: Bench, dtype: str, systems: list[str]) -> None:
    """Both servers up at once; at each concurrency every system runs back to back, so
    the load other work puts on the shared cores hits them alike."""
    with contextlib.ExitStack() as stack:
        targets = []
        if "shardserve" in systems:
            targets.append(start_ours(stack, dtype, [], "tp1 pp1"))
        if "hf-serve" in systems:
            targets.append(start_hf_serve(stack, dtype, bench.model))
        for target in targets:
            bench.http_point(target, dtype, None, "")
        for c in bench.concurrencies:
            alternate(bench, [(t, "tp1 pp1") for t in targets], dtype, c)
            if "hf-generate" in systems:
                bench.generate_point(dtype, c)


def alternate(bench: Bench, targets: list[tuple[Target, str]], dtype: str, c: int) -> None:
    """Every (target, layout) at concurrency ``c``, ``repeats(c)`` rounds, the order reversed
    every other round, so that a slow spell of the machine falls on them alike."""
    for r in range(repeats(c)):
        for target, layout in targets if r % 2 == 0 else targets[::-1]:
            bench.http_point(target, dtype, c, layout, r)


def run_parallel(bench: Bench, flag_help: str) -> None:
    """tp=2 vs tp=1 (12-head variant: 9 heads do not split in 2) and pp=2 overlap on/off."""
    c = PARALLEL_CONCURRENCY
    pp2 = ["-pp", "2"]
    if "--pp-layer-partition" in flag_help:  # the LM-head stage takes fewer layers
        pp2 += ["--pp-layer-partition", "balanced"]
    pairs: list[list[tuple[list[str], str, Variant]]] = [
        [([], "tp1 (12-head variant)", "tp2"), (["-tp", "2"], "tp2 (12-head variant)", "tp2")],
        [(pp2, "pp2 overlapped", "main")],
    ]
    if "--no-pipeline-overlap" in flag_help:
        pairs[1].append(([*pp2, "--no-pipeline-overlap"], "pp2 not overlapped", "main"))
    else:
        bench.notes.append(
            "pp2 not overlapped: skipped, `shardserve serve` has no "
            "--no-pipeline-overlap flag in this checkout"
        )
    for pair in pairs:  # both servers of a pair up at once, measured in turn
        with contextlib.ExitStack() as stack:
            targets = []
            for flags, layout, variant in pair:
                target = start_ours(stack, "float32", flags, layout, variant)
                bench.http_point(target, "float32", None, "")
                targets.append((target, layout))
            alternate(bench, targets, "float32", c)


FAMILY_LAYOUT = "qwen3-shaped"


def run_families(bench: Bench) -> None:
    """The Qwen3-shaped variant at concurrency 32 in float32: ours against ``transformers
    serve`` (both up, alternating) and ``generate()``, the main table's ratios."""
    c, dtype = PARALLEL_CONCURRENCY, "float32"
    model = ensure_model("qwen3")
    with contextlib.ExitStack() as stack:
        ours = start_ours(stack, dtype, [], FAMILY_LAYOUT, "qwen3")
        hf = start_hf_serve(stack, dtype, model)
        for target in (ours, hf):
            bench.http_point(target, dtype, None, "")
        alternate(bench, [(ours, FAMILY_LAYOUT), (hf, FAMILY_LAYOUT)], dtype, c)
    bench.generate_point(dtype, c, model, FAMILY_LAYOUT)


def machine() -> dict[str, Any]:
    import torch
    import transformers

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--systems", default="shardserve,hf-serve,hf-generate")
    parser.add_argument("--no-parallel", dest="parallel", action="store_false")
    parser.add_argument("--no-families", dest="families", action="store_false")
    parser.add_argument("--no-moe", dest="moe", action="store_false")
    parser.add_argument("--no-structured", dest="structured", action="store_false")
    parser.add_argument("--no-vlm", dest="vlm", action="store_false")
    parser.add_argument("--no-contention", dest="contention", action="store_false")
    parser.add_argument("--no-ttft", dest="ttft", action="store_false")
    parser.add_argument("--out", default=str(HERE / "results" / "latest.json"))
    parser.add_argument("--readme", default=str(HERE / "README.md"), help="'' to skip")
    return parser.parse_args(argv)


def measure_roofline() -> dict[str, Any]:
    """This machine's roofline, measured in a fresh subprocess (:mod:`benchmarks.roofline`)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.roofline"],
        cwd=servers.REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    roofline: dict[str, Any] = json.loads(done.stdout)
    return roofline


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
    args = _parse_args(argv)
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
            sweep(bench, dtype, systems)
        if args.parallel:
            run_parallel(bench, servers.ours_flags())
        if args.families:
            run_families(bench)
        if args.moe:
            moe_bench.run_moe(bench, PARALLEL_CONCURRENCY)
        if args.structured:
            structured.run_structured(bench, PARALLEL_CONCURRENCY)
        if args.vlm:
            from benchmarks import vlm_bench  # LLaVA and Qwen2.5-VL images (own models)

            vlm_bench.run_vlm(bench)
        if args.contention:
            contention.run_contention(bench)
    except KeyboardInterrupt:
        print("interrupted: every server was stopped; writing what was measured", flush=True)
        bench.notes.append("run interrupted before the end")
    result = result_json(bench, roofline, time.monotonic() - started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(report.render(result))
    if args.readme:
        report.write_readme(result, Path(args.readme))
    return 0


if __name__ == "__main__":
    sys.exit(main())
