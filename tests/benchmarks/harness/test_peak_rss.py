"""Peak RSS per rank from a ``/proc`` tree: the spawned ranks, not the resource tracker."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.harness.peak_rss import peak_rss_mib, server_peak_rss


def _process(proc: Path, pid: int, cmdline: str, hwm_kb: int, children: str = "") -> None:
    task = proc / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (task / "children").write_text(children)
    (proc / str(pid) / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())
    (proc / str(pid) / "status").write_text(f"Name:\tx\nVmHWM:\t {hwm_kb} kB\nVmRSS:\t 1 kB\n")


def test_ranks_are_the_spawned_children(tmp_path: Path) -> None:
    _process(tmp_path, 10, "python -m server.cli serve", 204800, "11 12")
    _process(tmp_path, 11, "python -c from multiprocessing.resource_tracker import main", 9216)
    spawned = "python -c from multiprocessing.spawn import spawn_main --multiprocessing-fork"
    _process(tmp_path, 12, spawned, 512000)
    assert server_peak_rss(10, tmp_path) == {"ranks": [500.0], "frontend": 200.0}


def test_a_one_process_server_is_its_own_rank(tmp_path: Path) -> None:
    _process(tmp_path, 20, "llama-server --model x.gguf", 102400)
    assert server_peak_rss(20, tmp_path) == {"ranks": [100.0], "frontend": None}
    assert peak_rss_mib(21, tmp_path) is None  # gone


def test_this_process_has_a_peak() -> None:
    assert (peak_rss_mib(os.getpid()) or 0) > 1
