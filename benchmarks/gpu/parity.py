"""Part (a) of ``make gpu-check``: the parity tests on the GPU, once per dtype.

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
from pathlib import Path
from typing import Any

from benchmarks.gpu.procs import REPO, Procs

# In the order they run, so that a run cut at its cap has covered the most per second: the
# backends' kernels against the reference first (about 200 quick tests, the Triton kernels
# compiled for the device), then whole models. The first H200 run (2026-12-04) spent its
# 75 s on one Llama layout and the family fixture's set-up (259 s there) with these last.
# Some backend tests run only here (skipped on CPU): the FP8 GEMM's native e4m3 dot and the
# cuBLASLt _scaled_mm path (sm89+), the W4A16 GEMM at a decode shape (tests/.../cuda/).
PARITY_TESTS = (
    "tests/model_shards/backends",
    "tests/model_shards/models/test_llama_parity.py",
    "tests/model_shards/engine/test_engine_batching.py",
    "tests/test_http_parity.py",
    "tests/model_shards/models/test_family_parity.py",
)
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


def run_parity(procs: Procs, device: str, dtype: str, cap_s: float, log: Path) -> dict[str, Any]:
    """One pytest run of the parity tests on ``device`` in ``dtype``, killed at ``cap_s``."""
    present = [t for t in PARITY_TESTS if (REPO / t).exists()]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *present]
    env = {"SHARDSERVE_TEST_DEVICE": device, "SHARDSERVE_TEST_DTYPE": dtype}
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
        "absent": sorted(set(PARITY_TESTS) - set(present)),  # not in this checkout
        "tail": "" if parity_ok({"rc": rc, "counts": counts}) else proc.log_tail(1500),
    }
