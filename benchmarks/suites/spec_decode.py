"""``make bench``'s speculative-decoding rows: n-gram and draft-model proposals against none, on
the real model.

The packaged SmolLM2-135M-Instruct GGUF, served several times at once: plain, with
``--speculative-config`` (:data:`NGRAM`), and (at concurrency 1 only) with a draft model
(:data:`DRAFTS`, written by :mod:`.spec_draft`, ``num_speculative_tokens`` :data:`DRAFT_K`): a
2-layer draft of SmolLM2's shape and vocabulary with random weights (what a draft distilled from
nothing accepts), SmolLM2 cut after its first 2 layers (an early-exit draft), and SmolLM2 as its
own draft (every draft accepted: the ceiling of what the draft's forwards cost). Two workloads,
as ChatML prompts on ``/completions`` (greedy, at most ``OUTPUT_LEN`` tokens, each request
ending at the model's end of turn as a user's would — with ``ignore_eos`` the 135M model writes
a fresh chat turn past it, a third of the editing point's tokens and nothing a user reads):
**editing** hands over a code or text block and asks for it back with a small change (the output
quotes the prompt: prompt lookup's best case); **chat** asks plain questions (little to look up:
speculation should cost nearly nothing). Concurrency 1 for both (the issue's targets: editing >=
1.5x, chat >= 0.95x), and 32 on chat (``disable_by_batch_size`` turns speculation off: within
3%). Each point runs every server in turn, ``ROUNDS`` times, the order alternating; each request
opens with its own line, so no round hits another's prefix cache, and every server of a round
gets the same prompts, so (greedy identity) they produce the same tokens: with requests ending
at their end of turn, tok/s compares the same work. The speculative rows carry the
acceptance the load tester read from ``/metrics``. Alone::

    python -m benchmarks suites spec_decode [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import http_load, servers
from benchmarks.harness.bench import Bench
from benchmarks.harness.paths import CACHE
from benchmarks.harness.spec_prompts import NGRAM, OUTPUT_LEN, prompts
from benchmarks.harness.tables import ratio
from benchmarks.suites.spec_draft import write_draft
from model_shards.launch import packaged_model

SPEC_NGRAM, SPEC_NONE = "ngram", "none"
DRAFT_K = 3
# system name → (layers, seed) of spec_draft.write_draft; (0, None): the target itself
DRAFTS = {"draft-random-2l": (2, 0), "draft-first-2l": (2, None), "draft-self": (0, None)}
POINTS = ((1, "editing"), (1, "chat"), (32, "chat"))
ROUNDS, DTYPE = 3, "bfloat16"
C1_REQUESTS = 8  # a c=1 point of 4 requests took ~2 s: one slow spell moved it 10%
POINT_CAP_S, REQUEST_TIMEOUT_S = 240.0, 300.0
LAYOUT = "smollm2 speculative"
LOGS = CACHE / "logs"


def dataset(workload: str, count: int, tag: str) -> str:
    path = CACHE / "data" / f"spec-{tag}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        json.dumps({"prompt": p, "output_len": OUTPUT_LEN}) for p in prompts(workload, count, tag)
    ]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def run_spec(
    bench: Bench | Results, points: tuple[tuple[int, str], ...] = POINTS, rounds: int = ROUNDS
) -> None:
    """The rows (and a note) into ``bench``: every point, every server (the draft-model ones at
    concurrency 1 only), ``rounds`` times."""
    model = packaged_model.packaged_gguf()
    flags = {SPEC_NONE: [], SPEC_NGRAM: ["--speculative-config", json.dumps(NGRAM)]}
    if any(c == 1 for c, _ in points):
        flags.update(draft_flags(model))
    with contextlib.ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                servers.running(
                    servers.ours_command(model, DTYPE, extra), LOGS / f"spec-{name}.log"
                )
            )
            for name, extra in flags.items()
        }
        for name, url in urls.items():  # warm-up
            http_load.run_point(
                url, "", dataset("chat", 2, f"warm-{name}"), 1, 2, OUTPUT_LEN,
                hf_serve=False, duration_s=POINT_CAP_S, timeout_s=REQUEST_TIMEOUT_S,
                ignore_eos=False,
            )  # fmt: skip
        for c, workload in points:
            systems = [n for n in urls if c == 1 or n in (SPEC_NONE, SPEC_NGRAM)]
            for r in range(rounds):
                order = systems if r % 2 == 0 else systems[::-1]
                for name in order:
                    tag = f"{workload}-c{c}-r{r}"  # every server the same prompts
                    metrics = http_load.run_point(
                        urls[name], "", dataset(workload, max(C1_REQUESTS, 2 * c), tag), c,
                        max(C1_REQUESTS, 2 * c), OUTPUT_LEN, hf_serve=False,
                        duration_s=POINT_CAP_S, timeout_s=REQUEST_TIMEOUT_S, ignore_eos=False,
                    )  # fmt: skip
                    bench.rows.append(_row(name, workload, c, r, metrics))
    bench.notes.append(
        f"speculative rows: greedy, at most {OUTPUT_LEN} tokens, ending at the end of turn; "
        f"n-gram config {NGRAM}; draft models "
        f"(c=1 only, num_speculative_tokens {DRAFT_K}): {', '.join(DRAFTS)}"
    )


def draft_flags(model: Path) -> dict[str, list[str]]:
    """The ``--speculative-config`` of each :data:`DRAFTS` system (drafts written once)."""
    out = {}
    for name, (layers, seed) in DRAFTS.items():
        path = model if layers == 0 else CACHE / "drafts" / f"smollm2-{name}.gguf"
        if layers:
            write_draft(model, path, layers, seed)
        spec = {"model": str(path), "num_speculative_tokens": DRAFT_K}
        out[name] = ["--speculative-config", json.dumps(spec)]
    return out


@dataclass
class Results:
    """Rows and notes of a run of this suite alone (``make bench`` passes its ``Bench``)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _row(name: str, workload: str, c: int, r: int, m: dict[str, Any]) -> dict[str, Any]:
    return {
        "layout": LAYOUT,
        "system": name,
        "workload": workload,
        "concurrency": c,
        "round": r,
        "output_throughput": m["output_throughput"],
        "spec_acceptance": m.get("spec_acceptance"),
        "spec_tokens_per_step": m.get("spec_tokens_per_step"),
        "errors": m["errors"],
    }


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = sorted(float(r[key]) for r in rows if r.get(key) is not None)
    return values[(len(values) - 1) // 2] if values else None


def spec_table(result: dict[str, Any]) -> str:
    """Markdown: per point and speculative system, tok/s without and with it, the ratio and the
    acceptance."""
    rows = [r for r in result["rows"] if r.get("layout") == LAYOUT]
    if not rows:
        return "(speculative decoding not measured)"
    lines = [
        "| workload | concurrency | system | tok/s none | tok/s | ratio | accepted | tokens/step |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c, workload in dict.fromkeys((r["concurrency"], r["workload"]) for r in rows):
        point = [r for r in rows if (r["concurrency"], r["workload"]) == (c, workload)]
        none = _median([r for r in point if r["system"] == SPEC_NONE], "output_throughput")
        for system in dict.fromkeys(r["system"] for r in point if r["system"] != SPEC_NONE):
            fast = [r for r in point if r["system"] == system]
            tok_s = _median(fast, "output_throughput")
            acc, per_step = _median(fast, "spec_acceptance"), _median(fast, "spec_tokens_per_step")
            lines.append(
                f"| {workload} | {c} | {system} | {none or 0:.1f} | {tok_s or 0:.1f} | "
                f"{ratio(tok_s, none)} | {'—' if acc is None else f'{100 * acc:.0f}%'} | "
                f"{'—' if per_step is None else f'{per_step:.2f}'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, c=1 points only")
    parser.add_argument("--out", help="also write the rows and notes as JSON here")
    args = parser.parse_args(argv)
    bench = Results()
    points = tuple(p for p in POINTS if p[0] == 1) if args.quick else POINTS
    run_spec(bench, points, 1 if args.quick else ROUNDS)
    result = {"rows": bench.rows, "notes": bench.notes}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(spec_table(result))
    print("\n".join(f"- {note}" for note in bench.notes))
    return 0
