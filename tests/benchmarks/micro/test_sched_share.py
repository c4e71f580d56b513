"""The scheduler-share probe builds, runs in its shapes and is measured, then leaves nothing
behind (its sibling process included); what share the kernel gives is the bench's to print."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks.micro import sched_share
from model_shards.launch.cpu_governor import family_pids

pytestmark = pytest.mark.timeout(60)


def test_probe_with_its_sibling_is_measured_and_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[int]] = []
    measured = sched_share.read_family_cpu_s

    def spy(root: int) -> float:
        seen.append(family_pids(root))
        return measured(root)

    monkeypatch.setattr(sched_share, "read_family_cpu_s", spy)
    shape = sched_share.SHAPES["+ 1 kHz waker + sibling (vLLM's shape)"]
    ours, theirs = sched_share.measure(shape, neighbours=1, seconds=0.3)
    assert 0.0 < ours <= len(os.sched_getaffinity(0))
    assert len(theirs) == 1 and theirs[0] > 0.0
    assert len(seen[0]) == 2  # the probe and its sibling process, one family
    deadline = time.monotonic() + 5.0  # SIGKILL to the probe's group: gone within moments
    while any(_alive(pid) for pid in seen[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in seen[0])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
