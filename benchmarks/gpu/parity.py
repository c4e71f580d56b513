"""Part (a) of ``make gpu-check``: the tests on the GPU, in the runs of :data:`PARITY_RUNS`.

``pytest -q`` on :data:`PARITY_TESTS` with ``SHARDSERVE_TEST_DEVICE`` and
``SHARDSERVE_TEST_DTYPE`` set (``tests/world.py`` and the live test servers read them),
in its own process group, killed at its time cap. The counts come from pytest's final
summary line (``3 failed, 120 passed, 2 skipped in 41.20s``); a run killed at its cap
has none, so its counts are read off the ``-q`` progress lines instead (``..F.s``).
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu.procs import REPO, Procs

# The runs of the check's part (a), in order: the backends' kernels against the reference
# first (about 200 quick tests, the Triton kernels compiled for the device; some run only on a
# GPU: the FP8 GEMM's native e4m3 dot and cuBLASLt _scaled_mm on sm89+, the W4A16 GEMM at a
# decode shape), then whole models in bfloat16 (tp=1: one GPU), then tp=2 on that one GPU
# (SHARDSERVE_SHARED_GPU: both ranks on cuda:0, tensors over gloo) in float32, where its greedy
# tokens must equal tp=1's. The first H200 run (2026-12-04) spent 259 s in the family
# parity fixture's set-up alone (transformers' references on the host's CPU), more than the
# whole parity slot of the 8-minute budget (settings.PHASE_SLOTS): that file is left out; the
# graph_parity phase runs every family on the device against the reference backend instead.
BACKEND_TESTS = ("tests/model_shards/backends",)
MODEL_TESTS = (
    "tests/model_shards/models/test_llama_parity.py",
    "tests/model_shards/engine/test_engine_batching.py",
    "tests/test_http_parity.py",
)
SHARED_GPU_TESTS = ("tests/model_shards/parallel/test_shared_gpu.py",)
PARITY_TESTS = (*BACKEND_TESTS, *MODEL_TESTS)


@dataclass(frozen=True, slots=True)
class ParityRun:
    """One pytest run: its key under ``results["parity"]``, its tests, dtype and env."""

    key: str
    title: str
    tests: tuple[str, ...]
    dtype: str
    env: tuple[tuple[str, str], ...] = ()
    share: float = 1 / 3  # of the parity cap


PARITY_RUNS = (
    ParityRun("backends", "backend kernel tests (tests/model_shards/backends)", BACKEND_TESTS,
              "bfloat16", share=0.35),
    ParityRun("bfloat16", "model parity tests, bfloat16", MODEL_TESTS, "bfloat16", share=0.45),
    ParityRun("tp2_shared", "tp=2 on one GPU over gloo = tp=1 greedy", SHARED_GPU_TESTS,
              "float32", (("SHARDSERVE_SHARED_GPU", "1"),), share=0.2),
)  # fmt: skip
OUTCOMES = ("passed", "failed", "errors", "skipped", "xfailed", "xpassed", "deselected")
_SINGULAR = {"error": "errors", "warning": "warnings"}
_SUMMARY = re.compile(r"^(?P<body>.+?)\s+in\s+(?P<secs>\d+(?:\.\d+)?)s\b")
_ITEM = re.compile(r"^(\d+) ([a-z]+)$")
_PROGRESS = re.compile(r"^([.FEsxX]+)\s*(?:\[\s*\d+%\])?$")
_PROGRESS_CHARS = {
    ".": "passed",
    "F": "failed",
    "E": "errors",
    "s": "skipped",
    "x": "xfailed",
    "X": "xpassed",
}


def _counts(body: str) -> dict[str, int] | None:
    """``"1 failed, 3 passed, 1 warning"`` → counts (every outcome present), else ``None``."""
    counts = dict.fromkeys((*OUTCOMES, "warnings"), 0)
    if body == "no tests ran":
        return counts
    for part in body.split(","):
        item = _ITEM.match(part.strip())
        if item is None:
            return None
        counts[_SINGULAR.get(item.group(2), item.group(2))] = int(item.group(1))
    return counts


def parse_summary(text: str) -> dict[str, Any] | None:
    """Counts and seconds of the last pytest summary line in ``text``, else ``None``.

    ``{"passed": 3, "failed": 1, ..., "warnings": 2, "seconds": 41.2, "line": "..."}``;
    every outcome of :data:`OUTCOMES` is present (0 when not mentioned).
    """
    for raw in reversed(text.splitlines()):
        line = raw.strip().strip("=").strip()
        match = _SUMMARY.match(line)
        counts = _counts(match.group("body")) if match else None
        if match and counts is not None:
            return {**counts, "seconds": float(match.group("secs")), "line": line}
    return None


def parse_progress(text: str) -> dict[str, int]:
    """Outcome counts from ``pytest -q`` progress lines (for a run cut short)."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for raw in text.splitlines():
        match = _PROGRESS.match(raw.strip())
        if match:
            for char in match.group(1):
                counts[_PROGRESS_CHARS[char]] += 1
    return counts


def parity_ok(result: dict[str, Any]) -> bool:
    """Finished, something passed, nothing failed or errored."""
    counts = result.get("counts") or {}
    return (
        not result.get("timed_out")
        and result.get("rc") == 0
        and counts.get("passed", 0) > 0
        and counts.get("failed", 0) == 0
        and counts.get("errors", 0) == 0
    )


def run_parity(
    procs: Procs,
    device: str,
    dtype: str,
    cap_s: float,
    log: Path,
    tests: tuple[str, ...] = PARITY_TESTS,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One pytest run of ``tests`` on ``device`` in ``dtype``, killed at ``cap_s``."""
    present = [t for t in tests if (REPO / t).exists()]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *present]
    env = {"SHARDSERVE_TEST_DEVICE": device, "SHARDSERVE_TEST_DTYPE": dtype, **(extra_env or {})}
    proc = procs.start(command, log, env)
    rc = proc.wait(cap_s)
    timed_out = rc is None
    if timed_out:
        procs.stop(proc)
    else:
        procs.stop(proc, grace_s=1.0)  # a test server left behind in its group
    wall = time.monotonic() - proc.started
    text = log.read_text(errors="replace")
    summary = None if timed_out else parse_summary(text)
    counts = summary if summary is not None else {**parse_progress(text), "seconds": wall}
    return {
        "device": device,
        "dtype": dtype,
        "rc": rc,
        "timed_out": timed_out,
        "cap_s": cap_s,
        "wall_s": wall,
        "counts": {k: counts[k] for k in (*OUTCOMES, "seconds")},
        "summary": summary["line"] if summary else None,
        "log": str(log),
        "absent": sorted(set(tests) - set(present)),  # not in this checkout
        "tail": "" if parity_ok({"rc": rc, "counts": counts}) else proc.log_tail(1500),
    }
