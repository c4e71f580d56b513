"""``make bench``'s llama.cpp rows: shardserve beside ``llama-server`` on the same real model.

SmolLM2-135M-Instruct in three GGUF types (:mod:`benchmarks.harness.gguf_models`): the shipped
``Q4_1``, and ``Q8_0`` and ``Q4_K_M`` made by llama.cpp's own converter and ``llama-quantize``
from the dequantized weights. A :class:`Peer` names, per type, the file ``llama-server``
serves and the model shardserve serves: ``--ours gguf`` (the default) gives shardserve each
GGUF file, its weights kept quantized; ``--ours hf`` the dequantized Hugging Face directory in
bfloat16, one server for all three types. shardserve's bfloat16 on the
dequantized directory is measured either way: quantized serving should not be slower at c=32.

Every server is up at once, llama-server with the CPU budget shardserve has
(:func:`benchmarks.harness.llamacpp.server_command`). At each concurrency every server runs
``ROUNDS[c]`` points, interleaved, the order reversed every other round (:func:`schedule`);
each point (and each server's warm-up) has prompts no other point has: llama-server reuses a
slot's cached prompt when the same text comes again. 32-token prompts, 64 greedy output
tokens (``ignore_eos``; ``n_predict`` for llama-server). After the last point each server's
peak RSS per rank (:mod:`benchmarks.harness.peak_rss`) goes into its rows. Alone::

    python -m benchmarks suites llamacpp_peer --quick
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from benchmarks.harness import gguf_models, http_load, llamacpp, quiesce, servers
from benchmarks.harness.bench import Bench
from benchmarks.harness.paths import CACHE
from benchmarks.harness.peak_rss import server_peak_rss
from benchmarks.harness.prompts import exact_prompts, write_dataset
from benchmarks.suites.llamacpp_table import BASELINE, LAYOUT, LLAMA, OURS, peer_table

CONCURRENCIES = (1, 8, 32)
ROUNDS = {1: 3, 8: 2, 32: 3}
QUICK_CONCURRENCIES, QUICK_ROUNDS = (1, 32), {1: 1, 32: 1}
PROMPT_LEN, OUTPUT_LEN = 32, 64
POINT_CAP_S, REQUEST_TIMEOUT_S = 60.0, 300.0
WARMUP_REQUESTS = 2
LOGS = CACHE / "logs"


def num_requests(concurrency: int) -> int:
    """Two full waves per point, at least 8 requests (a c=1 point of 4 was ~2.5 s: one slow
    spell moved it by 10%)."""
    return max(8, 2 * concurrency)


@dataclass(frozen=True, slots=True)
class Peer:
    """One GGUF type: the file llama-server serves; the model and dtype shardserve serves
    (``ours_label``: its rows' dtype column, the GGUF type or the dtype)."""

    kind: str
    gguf: Path
    ours_model: Path
    ours_dtype: str
    ours_label: str


def make_peers(
    kinds: list[str], ours: str, ours_dtype: str, hf_dir: Path, log: list[str]
) -> list[Peer]:
    """The :class:`Peer` of each type; ``ours``: ``hf`` (``hf_dir``, the dequantized
    weights) or ``gguf``. Files missing are made first (their steps timed into ``log``)."""
    peers = []
    for kind in kinds:
        gguf = gguf_models.ensure_gguf(kind, log)
        if ours == "gguf":
            peers.append(Peer(kind, gguf, gguf, ours_dtype, kind))
        else:
            peers.append(Peer(kind, gguf, hf_dir, BASELINE, BASELINE))
    return peers


@dataclass(frozen=True, slots=True)
class Server:
    """A running server: ``system`` and ``label`` key its rows; ``name`` is unique."""

    system: str
    label: str
    url: str
    model: str
    pid: int

    @property
    def name(self) -> str:
        return f"{self.system} {self.label}"


def start_servers(
    stack: contextlib.ExitStack,
    peers: list[Peer],
    hf_dir: Path,
    notes: list[str],
    llama_flags: list[str],
) -> list[Server]:
    """shardserve once per distinct (model, dtype), its bfloat16 baseline included, then one
    llama-server per peer (built first if need be, its steps timed into ``notes``;
    ``llama_flags`` appended to its command); each stopped when ``stack`` closes."""
    ours = {(hf_dir, BASELINE): BASELINE}
    ours.update({(p.ours_model, p.ours_dtype): p.ours_label for p in peers})
    started = []
    for (model, dtype), label in ours.items():
        log = LOGS / f"peer-shardserve-{label}.log"
        url = stack.enter_context(servers.running(servers.ours_command(model, dtype, []), log))
        started.append(Server(OURS, label, url, "", servers.pid_serving(url)))
    binary = llamacpp.ensure_binaries(notes)["llama-server"]
    for peer in peers:
        port = servers.free_port()
        command = [
            *llamacpp.server_command(binary, peer.gguf, port, max(CONCURRENCIES)),
            *llama_flags,
        ]
        log = LOGS / f"peer-llama-server-{peer.kind}.log"
        url = stack.enter_context(servers.running(command, log, f"http://127.0.0.1:{port}"))
        started.append(Server(LLAMA, peer.kind, url, "", servers.pid_serving(url)))
    return started


Point = tuple[str, int, int]
"""(server name, concurrency, round); round ``-1``: the server's warm-up."""


def schedule(names: list[str], concurrencies: list[int], rounds: dict[int, int]) -> list[Point]:
    """Every server's warm-up, then at each concurrency ``rounds[c]`` passes over every
    server, the order reversed every other pass (a slow spell falls on all alike)."""
    points: list[Point] = [(name, WARMUP_REQUESTS, -1) for name in names]
    passes = 0
    for c in concurrencies:
        for r in range(rounds[c]):
            order = names if passes % 2 == 0 else names[::-1]
            points += [(name, c, r) for name in order]
            passes += 1
    return points


def point_requests(point: Point) -> int:
    return WARMUP_REQUESTS if point[2] < 0 else num_requests(point[1])


def write_datasets(tokenizer: Tokenizer, points: list[Point], data: Path) -> dict[Point, str]:
    """A JSONL dataset per point, no prompt in two of them (one draw, cut in turn)."""
    total = sum(point_requests(p) for p in points)
    prompts = exact_prompts(tokenizer, total, PROMPT_LEN, seed="llamacpp-peer-v1")
    datasets, start = {}, 0
    for point in points:
        count = point_requests(point)
        name, c, r = point
        path = data / f"peer-{name.replace(' ', '_')}-c{c}-r{r}.jsonl"
        ids = prompts[start : start + count]
        datasets[point] = str(write_dataset(tokenizer, ids, OUTPUT_LEN, path))
        start += count
    return datasets


def request_fields(server: Server) -> dict[str, Any]:
    """Fields beyond the load tester's (``max_tokens``, ``ignore_eos``, ``temperature``)."""
    return {"n_predict": OUTPUT_LEN} if server.system == LLAMA else {}


def run_point(bench: Bench, server: Server, point: Point, dataset: str) -> None:
    """One load point; recorded in ``bench`` unless it is a warm-up."""
    _, c, r = point
    quiesce.before_point(bench.notes, f"{server.name} {LAYOUT} c={c}")
    load_before = os.getloadavg()[0]
    metrics = http_load.run_point(
        server.url,
        server.model,
        dataset,
        c,
        point_requests(point),
        OUTPUT_LEN,
        hf_serve=False,
        duration_s=POINT_CAP_S,
        timeout_s=REQUEST_TIMEOUT_S,
        extra_body=request_fields(server),
    )
    if r < 0:
        return
    seen = (metrics["prompt_tokens_seen"], metrics["output_tokens_seen"])
    if metrics["completed"] and seen != ([PROMPT_LEN], [OUTPUT_LEN]):
        bench.notes.append(f"{server.name} c={c}: prompt/output tokens seen {seen}")
    tok_s = metrics["streamed_throughput"]
    bench.add(server.system, server.label, c, LAYOUT, tok_s, metrics, load_before)


def record_rss(bench: Bench, server: Server) -> None:
    """The server's peak RSS (``peak_rss_mib``: ranks and frontend) into each of its rows."""
    rss = server_peak_rss(server.pid)
    for row in bench.rows:
        if (row["system"], row["dtype"], row["layout"]) == (server.system, server.label, LAYOUT):
            row["peak_rss_mib"] = rss


def run_peer(
    bench: Bench,
    kinds: list[str] | None = None,
    concurrencies: list[int] | None = None,
    rounds: dict[int, int] | None = None,
    ours: str = "gguf",
    ours_dtype: str = BASELINE,
    llama_flags: list[str] | None = None,
) -> None:
    """The llama.cpp rows into ``bench`` (see the module doc); the set-up steps that ran
    (download, build, conversions) and their times go into its notes, and so do
    ``llama_flags`` when given (extra ``llama-server`` flags, e.g. ``--poll 50``: its
    default spin)."""
    concs = list(concurrencies or CONCURRENCIES)
    hf_dir = gguf_models.ensure_dequantized(bench.notes)
    peers = make_peers(list(kinds or gguf_models.KINDS), ours, ours_dtype, hf_dir, bench.notes)
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    with contextlib.ExitStack() as stack:
        started = start_servers(stack, peers, hf_dir, bench.notes, llama_flags or [])
        if llama_flags:
            bench.notes.append(f"llama-server extra flags: {shlex.join(llama_flags)}")
        by_name = {server.name: server for server in started}
        plan = schedule(list(by_name), concs, rounds or ROUNDS)
        datasets = write_datasets(tokenizer, plan, CACHE / "data")
        for point in plan:
            run_point(bench, by_name[point[0]], point, datasets[point])
        for server in started:
            record_rss(bench, server)


def parse_types(text: str) -> list[str]:
    """``--types``: comma-separated GGUF types, each of ``gguf_models.KINDS``."""
    kinds = text.split(",")
    wrong = [kind for kind in kinds if kind not in gguf_models.KINDS]
    if wrong:
        known = ", ".join(gguf_models.KINDS)
        raise argparse.ArgumentTypeError(f"unknown type(s) {', '.join(wrong)}; choose from {known}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="c=1 and 32, one round each")
    parser.add_argument("--types", type=parse_types, default=list(gguf_models.KINDS))
    parser.add_argument("--ours", choices=("hf", "gguf"), default="gguf")
    parser.add_argument("--ours-dtype", default=BASELINE, help="shardserve's --dtype (gguf)")
    parser.add_argument("--llama-flags", type=shlex.split, default=[], help="e.g. '--poll 50'")
    parser.add_argument("--out", help="also write the rows and notes as JSON here")
    args = parser.parse_args(argv)
    concs, rounds = (QUICK_CONCURRENCIES, QUICK_ROUNDS) if args.quick else (CONCURRENCIES, ROUNDS)
    bench = Bench([])
    run_peer(bench, args.types, list(concs), rounds, args.ours, args.ours_dtype, args.llama_flags)
    result = {"rows": bench.rows, "notes": bench.notes}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(peer_table(result))
    print("\n".join(f"- {note}" for note in bench.notes))
    return 0
