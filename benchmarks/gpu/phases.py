"""The phases of ``make gpu-check``; each stores what it measured into ``run.results``.

Order: the checkpoint build starts in the background, the parity tests run meanwhile,
then our server is measured and stopped, then Hugging Face ``generate()`` runs on the
freed GPU. A phase that fails records why under ``results["missing"][key]`` and the
run goes on with what does not depend on it; nothing is ever filled in by guess.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from benchmarks.gpu.parity import PARITY_RUNS, run_parity
from benchmarks.gpu.procs import Proc, Procs
from benchmarks.gpu.serve import (
    StartupFailed,
    scan_log,
    serve_command,
    summarize_point,
    wait_ready,
)
from benchmarks.gpu.settings import Budget, Settings, reserved_after
from benchmarks.harness import http_load
from benchmarks.harness.servers import free_port

MIN_PHASE_S = 5.0  # a phase with less time than this left is skipped, not started
PROMPT_SEED = "gpu-check-v1"


class Skip(Exception):
    """Raised inside a phase to record a reason and move on."""


@dataclass
class Run:
    settings: Settings
    budget: Budget
    procs: Procs = field(default_factory=Procs)
    results: dict[str, Any] = field(default_factory=dict)

    def missing(self, key: str, reason: str) -> None:
        self.results.setdefault("missing", {})[key] = reason
        print(f"  missing {key}: {reason.splitlines()[0] if reason else ''}", flush=True)

    def note(self, text: str) -> None:
        self.results.setdefault("notes", []).append(text)

    def cap(self, key: str, cap_s: float) -> float:
        """``cap_s``, cut to the time left less the slots of the phases after ``key``'s
        (:data:`~benchmarks.gpu.settings.PHASE_SLOTS`; with ``settings.slots``)."""
        later = reserved_after(key) if self.settings.slots else 0.0
        return max(0.0, min(cap_s, self.budget.left() - later))

    def time_for(self, key: str, cap_s: float) -> float:
        """The phase's cap (:meth:`cap`); ``Skip`` when too little is left."""
        cap = self.cap(key, cap_s)
        if cap < MIN_PHASE_S:
            left = max(0.0, self.budget.left())
            later = reserved_after(key) if self.settings.slots else 0.0
            kept = f", {later:.0f} s of it kept for the later phases" if later else ""
            raise Skip(f"not started: {left:.0f} s left of the --timeout budget{kept}")
        return cap


@contextlib.contextmanager
def phase(run: Run, key: str) -> Iterator[None]:
    """Run a phase: a ``Skip`` or an error becomes ``missing[key]``; the run goes on."""
    run.results["phase"] = key
    print(f"[{run.budget.elapsed():6.1f} s] {key}", flush=True)
    try:
        yield
    except Skip as exc:
        run.missing(key, str(exc))
    except Exception as exc:
        run.missing(key, f"{type(exc).__name__}: {exc}")
        run.note(f"{key} failed:\n{traceback.format_exc(limit=4)}")


def start_build(run: Run) -> Proc:
    s = run.settings
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "gpu",
        "build_model",
        str(s.model_dir),
        "--shape",
        s.shape_name,
        "--device",
        s.device,
        "--dtype",
        s.dtype,
    ]
    return run.procs.start(command, s.logs_dir / "build.log")


def finish_build(run: Run, proc: Proc) -> bool:
    """Wait for the checkpoint; True when it is there (``results["model"]["build"]``)."""
    with phase(run, "model"):
        rc = proc.wait(run.cap("model", run.settings.build_cap_s))  # 0 s: done or not
        if rc is None:
            run.procs.stop(proc)
            raise Skip(f"checkpoint not built in time; log tail:\n{proc.log_tail()}")
        run.procs.stop(proc, grace_s=1.0)
        if rc != 0:
            raise RuntimeError(f"build exited with {rc}:\n{proc.log_tail()}")
        lines = proc.log.read_text().strip().splitlines()
        run.results["model"]["build"] = json.loads(lines[-1])
        return True
    return False


def parity(run: Run) -> None:
    """The runs of :data:`PARITY_RUNS`; each may use its share of the cap and what the runs
    before it left unused."""
    s = run.settings
    run.results["parity"] = {}
    if not s.parity:
        why = "--no-parity" if not s.smoke else "--smoke without --with-parity"
        for r in PARITY_RUNS:
            run.missing(f"parity.{r.key}", f"skipped ({why})")
        return
    start, allowed = run.budget.elapsed(), 0.0
    for r in PARITY_RUNS:
        key = f"parity.{r.key}"
        allowed += s.parity_cap_s * r.share
        with phase(run, key):
            cap = run.time_for(key, allowed - (run.budget.elapsed() - start))
            log = s.logs_dir / f"parity-{r.key}.log"
            result = run_parity(run.procs, s.device, r.dtype, cap, log, r.tests, dict(r.env))
            run.results["parity"][r.key] = result
            print(f"  {r.key}: {result['summary'] or result['counts']}", flush=True)


def make_prompts(run: Run) -> dict[str, list[list[int]]]:
    """Distinct exact-length prompts (as ids) for the warm-up, c=1 and c=32 points."""
    from tokenizers import Tokenizer

    from benchmarks.harness.prompts import exact_prompts

    s = run.settings
    tokenizer = Tokenizer.from_file(str(s.model_dir / "tokenizer.json"))
    counts = {"warmup": s.warmup_requests, "c1": s.requests_c1, "c32": s.requests_c32}
    ids = exact_prompts(tokenizer, sum(counts.values()), s.prompt_len, seed=PROMPT_SEED)
    out, start = {}, 0
    for key, n in counts.items():
        out[key], start = ids[start : start + n], start + n
    return out


def write_datasets(run: Run, prompts: dict[str, list[list[int]]]) -> dict[str, str]:
    """The prompts as text JSONL for the load tester (each round-trips to its ids)."""
    from tokenizers import Tokenizer

    from benchmarks.harness.prompts import write_dataset

    s = run.settings
    tokenizer = Tokenizer.from_file(str(s.model_dir / "tokenizer.json"))
    outputs = {"warmup": s.warmup_output, "c1": s.output_c1, "c32": s.output_c32}
    return {
        key: str(write_dataset(tokenizer, ids, outputs[key], s.work_dir / f"data/{key}.jsonl"))
        for key, ids in prompts.items()
    }


def load_point(run: Run, url: str, key: str, dataset: str, conc: int, n: int, out: int) -> None:
    with phase(run, f"ours.{key}"):
        cap = run.time_for(f"ours.{key}", run.settings.point_cap_s)
        metrics = http_load.run_point(
            url, "", dataset, conc, n, out, hf_serve=False, duration_s=cap, timeout_s=cap + 10
        )
        point = summarize_point(metrics, conc, run.settings.prompt_len, out)
        print(f"  c={conc}: {point['output_tok_s']:.1f} tok/s, errors {point['errors']}")
        if key == "warmup":
            return
        run.results["ours"][key] = point
        if point["errors"]:
            run.note(f"ours c={conc}: requests not completed {point['errors']} (cap {cap:.0f} s)")
        if not point["exact_lengths"]:
            run.note(
                f"ours c={conc}: prompt tokens seen {point['prompt_tokens_seen']}, output "
                f"tokens seen {point['output_tokens_seen']} (asked {run.settings.prompt_len}"
                f" and {out})"
            )


def ours(run: Run, datasets: dict[str, str]) -> None:
    """Start the server, read its start-up, run the points, stop it (always)."""
    s = run.settings
    run.results["ours"] = {}
    with phase(run, "ours"):
        cap = run.time_for("ours", s.start_cap_s)
        port = free_port()
        command = serve_command(
            s.model_dir, s.device, s.dtype, port, s.max_num_seqs, s.max_model_len
        )
        run.results["ours"]["command"] = " ".join(command)
        proc = run.procs.start(command, s.logs_dir / "server.log")
        try:
            _measure_server(run, proc, f"http://127.0.0.1:{port}", cap, datasets)
        finally:
            run.procs.stop(proc)
            text = proc.log.read_text(errors="replace")  # complete now: every line stamped
            run.results["ours"].setdefault("startup", {}).update(scan_log(text, proc.started_wall))


def _measure_server(run: Run, proc: Proc, url: str, cap: float, data: dict[str, str]) -> None:
    s = run.settings
    try:
        run.results["ours"]["startup"] = wait_ready(proc, url, cap)
    except StartupFailed as exc:
        run.results["ours"]["startup"] = exc.startup
        raise
    print(f"  start-up: {run.results['ours']['startup']}", flush=True)
    warm = min(32, s.warmup_requests)
    load_point(run, url, "warmup", data["warmup"], warm, s.warmup_requests, s.warmup_output)
    load_point(run, url, "c1", data["c1"], 1, s.requests_c1, s.output_c1)
    load_point(run, url, "c32", data["c32"], 32, s.requests_c32, s.output_c32)


def parse_events(text: str) -> list[dict[str, Any]]:
    """The ``{"event": ...}`` JSON lines of an ``hf_bench`` log (other output ignored)."""
    events = []
    for line in text.splitlines():
        start = line.find('{"event"')
        if start >= 0:
            with contextlib.suppress(ValueError):
                events.append(json.loads(line[start:]))
    return events


def hf(run: Run, prompts: dict[str, list[list[int]]]) -> None:
    """``generate()`` at batch 1 and 32 in a subprocess; results by point name."""
    s = run.settings
    run.results["hf"] = {}
    with phase(run, "hf"):
        cap = run.time_for("hf", s.hf_cap_s)
        points = [
            {"name": "b1", "batch": 1, "new_tokens": s.output_c1, "prompts": prompts["c1"][:1]},
            {"name": "b32", "batch": 32, "new_tokens": s.output_c32, "prompts": prompts["c32"]},
        ]
        spec = {"model_dir": str(s.model_dir), "device": s.device, "dtype": s.dtype}
        path = s.work_dir / "hf-spec.json"
        path.write_text(json.dumps({**spec, "points": points}))
        env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
        command = [sys.executable, "-m", "benchmarks", "gpu", "hf_bench", str(path)]
        proc = run.procs.start(command, s.logs_dir / "hf.log", env)
        rc = proc.wait(cap)
        run.procs.stop(proc, grace_s=5.0)
        _store_hf(run, proc, rc, cap)


def _store_hf(run: Run, proc: Proc, rc: int | None, cap: float) -> None:
    for event in parse_events(proc.log.read_text(errors="replace")):
        if event["event"] == "loaded":
            run.results["hf"]["load_s"] = event["load_s"]
            run.results["hf"]["load_path"] = event["load_path"]
        elif event["event"] == "point":
            run.results["hf"][event["name"]] = event
            print(f"  HF {event['name']}: {event['tok_s']:.1f} tok/s", flush=True)
    why = f"cut at {cap:.0f} s" if rc is None else f"exited with {rc}"
    for name in ("b1", "b32"):
        if name not in run.results["hf"]:
            run.missing(f"hf.{name}", f"HF generate {why} first; log tail:\n{proc.log_tail(800)}")
