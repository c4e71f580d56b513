"""Facts about this machine that go with every result: its CPU, cores and versions, and its
roofline (:mod:`benchmarks.harness.roofline`, measured in a fresh subprocess)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.harness.paths import REPO


def machine() -> dict[str, Any]:
    """The CPU, its cores (all and usable), the versions of torch, transformers and Python,
    and the date."""
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


def measure_roofline() -> dict[str, Any]:
    """This machine's roofline (:mod:`benchmarks.harness.roofline`) from a fresh subprocess."""
    command = [sys.executable, "-m", "benchmarks", "harness", "roofline"]
    out = subprocess.check_output(command, cwd=REPO, text=True, timeout=600)
    roofline: dict[str, Any] = json.loads(out)
    return roofline
