"""One run of ``make bench``: its settings, prompts, datasets, rows and notes (:class:`Bench`),
and the servers the suites start (:func:`start_ours`, :func:`start_hf_serve`).

Every point has its own fresh prompts (no prefix-cache hits) and waits until the servers
that are up are idle (:mod:`benchmarks.harness.quiesce`): one still computing requests
cancelled at the previous point's cap would share the cores with this one. A point that
ran more than once keeps every run and shows its median (:func:`tables.add_run`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from benchmarks.harness import http_load, quiesce, servers, tables
from benchmarks.harness.model import Variant, ensure_model
from benchmarks.harness.paths import CACHE, REPO
from benchmarks.harness.prompts import exact_prompts, write_dataset

PROMPT_LEN, OUTPUT_LEN = 32, 64
PARALLEL_CONCURRENCY = 32  # the tp/pp, family, MoE and structured-output rows
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
            "benchmarks",
            "harness",
            "hf_generate",
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
                cwd=REPO,
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
        tables.add_run(self.rows, (system, dtype, c, layout), run)
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
    env = {"PYTHONPATH": f"{servers.PYDEPS}:{REPO}"}
    url = stack.enter_context(servers.running(command, log, f"http://127.0.0.1:{port}", env))
    return ("hf-serve", url, str(model))


def alternate(bench: Bench, targets: list[tuple[Target, str]], dtype: str, c: int) -> None:
    """Every (target, layout) at concurrency ``c``, ``repeats(c)`` rounds, the order reversed
    every other round, so that a slow spell of the machine falls on them alike."""
    for r in range(repeats(c)):
        for target, layout in targets if r % 2 == 0 else targets[::-1]:
            bench.http_point(target, dtype, c, layout, r)
