"""The check's phases that run a device script of this folder in a subprocess and keep its
JSON events: graph parity on the families' tiny checkpoints, the step breakdown and the
compiled ceiling on the served checkpoint. Each is capped, killed at its cap, and leaves
what its events said (a phase cut part-way keeps the points it finished)."""

from __future__ import annotations

import json
import sys
from typing import Any

from benchmarks.gpu.phases import Run, parse_events, phase

BATCHES = (1, 32)


def run_script(run: Run, key: str, module: str, spec: dict[str, Any], cap_s: float) -> list[dict]:
    """``python -m benchmarks gpu <module> spec.json`` within ``cap_s``; its events.

    A script that exits non-zero or is cut records why under ``missing[key]`` (with its
    log's tail) after its events are returned to the caller's store."""
    s = run.settings
    path = s.work_dir / f"{module}-spec.json"
    path.write_text(json.dumps(spec))
    command = [sys.executable, "-m", "benchmarks", "gpu", module, str(path)]
    proc = run.procs.start(command, s.logs_dir / f"{module}.log")
    rc = proc.wait(cap_s)
    run.procs.stop(proc, grace_s=5.0)
    if rc != 0:
        why = f"cut at {cap_s:.0f} s" if rc is None else f"exited with {rc}"
        run.missing(key, f"{module} {why}; log tail:\n{proc.log_tail(800)}")
    return parse_events(proc.log.read_text(errors="replace"))


def _model_spec(run: Run) -> dict[str, Any]:
    s = run.settings
    return {"model_dir": str(s.model_dir), "device": s.device, "dtype": s.dtype}


def graph_parity(run: Run) -> None:
    """Every decoder family's tiny checkpoint: the device backend against the reference
    backend (prompt logits, greedy tokens) and its graph replay against its eager steps."""
    s = run.settings
    run.results["graph_parity"] = {}
    with phase(run, "graph_parity"):
        cap = run.time_for("graph_parity", s.graph_parity_cap_s)
        spec = {"device": s.device, "dtype": s.dtype, "work_dir": str(s.work_dir / "families")}
        for event in run_script(run, "graph_parity", "graph_parity", spec, cap):
            if event["event"] == "family":
                run.results["graph_parity"][event["name"]] = event


def step_breakdown(run: Run) -> None:
    s = run.settings
    run.results["step"] = {}
    with phase(run, "step"):
        cap = run.time_for("step", s.step_cap_s)
        spec = {**_model_spec(run), "prompt_len": s.prompt_len, "steps": 20,
                "batches": list(BATCHES), "piecewise": True}  # fmt: skip
        for event in run_script(run, "step", "step_breakdown", spec, cap):
            name = event.pop("event")
            if name == "step":
                run.results["step"][f"b{event['batch']}"] = event
            else:
                run.results["step"][name] = event
        print(f"  step: {json.dumps(run.results['step'].get('b1'))}", flush=True)


def ceiling(run: Run) -> None:
    s = run.settings
    run.results["ceiling"] = {}
    with phase(run, "ceiling"):
        cap = run.time_for("ceiling", s.ceiling_cap_s)
        spec = {**_model_spec(run), "prompt_len": s.prompt_len, "new_tokens": s.output_c1,
                "batches": list(BATCHES), "compile": not s.smoke}  # fmt: skip
        for event in run_script(run, "ceiling", "ceiling", spec, cap):
            if event["event"] == "loaded":
                run.results["ceiling"]["load_s"] = event["load_s"]
            elif event["event"] == "point":
                run.results["ceiling"][f"b{event['batch']}"] = event
                print(f"  ceiling b{event['batch']}: {event['tok_s']:.1f} tok/s", flush=True)
