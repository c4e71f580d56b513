"""The thread governor: its probes on fake ``/proc`` trees, its rules on a driven clock."""

from __future__ import annotations

import os
from pathlib import Path

from model_shards.launch.cpu_governor import (
    CpuTimes,
    Sample,
    ThreadGovernor,
    ThreadPlacement,
    current_cpu,
    family_pids,
    read_cpu_times,
    read_family_cpu_s,
    switched_off,
)

TICKS = os.sysconf("SC_CLK_TCK")


def test_cpu_times_of_the_affinity_cpus_only(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 900 900 0 0 0 0 0 0\n"
        f"cpu0 {TICKS} 0 {TICKS} {4 * TICKS} {TICKS} 0 0 {TICKS} 0 0\n"  # steal counts as busy
        f"cpu1 {2 * TICKS} {TICKS} 0 0 0 {TICKS} {TICKS} 0 0 0\n"
        f"cpu2 {100 * TICKS} 0 0 0 0 0 0 0 0 0\n"  # not ours
        "intr 12345\n"
    )
    assert read_cpu_times([0, 1], stat) == CpuTimes(busy=8.0, idle=5.0)
    assert read_cpu_times([0], stat) == CpuTimes(busy=3.0, idle=5.0)
    assert read_cpu_times([0], tmp_path / "missing") == CpuTimes(0.0, 0.0)


def fake_process(proc: Path, pid: int, utime: int, stime: int, children: list[int]) -> None:
    task = proc / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (task / "children").write_text(" ".join(map(str, children)) + (" " if children else ""))
    fields = ["S", "1"] + ["0"] * 9 + [str(utime), str(stime)] + ["0"] * 30
    (proc / str(pid) / "stat").write_text(f"{pid} (py thon (x)) " + " ".join(fields) + "\n")


def test_family_is_the_parent_and_all_its_descendants(tmp_path: Path) -> None:
    fake_process(tmp_path, 10, TICKS, TICKS, [11, 12])  # the frontend
    fake_process(tmp_path, 11, 3 * TICKS, 0, [13])  # rank 0 (with a child of its own)
    fake_process(tmp_path, 12, 0, TICKS, [])  # rank 1
    fake_process(tmp_path, 13, TICKS, 0, [])
    fake_process(tmp_path, 99, 50 * TICKS, 0, [])  # a neighbour: not family
    assert sorted(family_pids(10, tmp_path)) == [10, 11, 12, 13]
    assert read_family_cpu_s(10, tmp_path) == 7.0
    assert read_family_cpu_s(11, tmp_path) == 4.0
    assert read_family_cpu_s(404, tmp_path) == 0.0  # gone: nothing, no error


def test_the_real_probes_read_this_process() -> None:
    times = read_cpu_times(sorted(os.sched_getaffinity(0)))
    assert times.busy > 0 and times.idle >= 0
    assert os.getpid() in family_pids(os.getppid())
    assert read_family_cpu_s(os.getpid()) > 0


def test_switch() -> None:
    assert not switched_off({}) and not switched_off({"SHARDSERVE_THREAD_GOVERNOR": "1"})
    for off in ("0", "false", "OFF", "no"):
        assert switched_off({"SHARDSERVE_THREAD_GOVERNOR": off})


class FakeMachine:
    """A clock and probe the test drives: each window, how much of our CPUs other work
    used, how much sat idle, and how much our processes used."""

    def __init__(self) -> None:
        self.now = self.busy = self.idle = self.ours = 0.0
        self.set_to: list[int] = []

    def advance(self, other: float, idle: float, ours: float, seconds: float) -> None:
        self.busy += (other + ours) * seconds
        self.idle += idle * seconds
        self.ours += ours * seconds
        self.now += seconds

    def run(
        self,
        g: ThreadGovernor,
        other: float,
        idle: float,
        ours: float = 1.3,
        seconds: float = 0.5,
        gap: float = 0.0,
    ) -> None:
        """``gap`` seconds idle (other work as given), then one step of ``seconds``, then a
        tick that judges the window."""
        self.advance(other, idle, 0.0, gap)
        g.wrap(lambda: self.advance(other, idle, ours, seconds))()
        g.tick()

    def sample(self) -> Sample:
        return Sample(self.now, CpuTimes(self.busy, self.idle), self.ours)

    def governor(self, threads: int) -> ThreadGovernor:
        return ThreadGovernor(
            threads, self.set_to.append, clock=lambda: self.now, sample=self.sample
        )


def test_governor_drops_a_thread_under_contention_and_restores_it() -> None:
    m = FakeMachine()
    g = m.governor(2)
    m.run(g, other=0.1, idle=0.0, ours=1.9)  # quiet but for a load generator: keeps 2
    m.run(g, other=0.7, idle=0.0)  # a busy neighbour: one window is not enough
    assert m.set_to == []
    m.run(g, other=0.7, idle=0.0)
    assert m.set_to == [1] and g.threads == 1
    for _ in range(3):  # the neighbour keeps a whole core: stays at 1
        m.run(g, other=1.0, idle=0.1, ours=0.9)
    assert m.set_to == [1]
    m.run(g, other=0.2, idle=0.8, ours=1.0)  # the neighbour stopped
    m.run(g, other=0.2, idle=0.8, ours=1.0)
    assert m.set_to == [1, 2] and g.threads == 2
    for _ in range(2):  # never above the planned count
        m.run(g, other=0.0, idle=0.0, ours=2.0)
    assert m.set_to == [1, 2]


def test_what_ran_while_we_sat_idle_does_not_count() -> None:
    m = FakeMachine()
    g = m.governor(2)
    for _ in range(4):  # another server busy while we wait for requests, a short step each
        m.run(g, other=1.8, idle=0.0, ours=0.2, seconds=0.05, gap=5.0)
    assert m.set_to == []


def test_a_step_after_a_pause_starts_again_at_the_planned_count() -> None:
    m = FakeMachine()
    g = m.governor(2)
    for _ in range(2):  # a busy neighbour while we step: one thread
        m.run(g, other=0.9, idle=0.0)
    assert m.set_to == [1]
    m.run(g, other=0.9, idle=0.0, gap=1.0)  # a short pause keeps it
    assert m.set_to == [1]
    m.run(g, other=0.0, idle=1.0, gap=3.0)  # a longer one: the next burst starts at two
    assert m.set_to == [1, 2] and g.threads == 2
    for _ in range(2):  # ... and a neighbour still there takes it again, two windows later
        m.run(g, other=0.9, idle=0.0)
    assert m.set_to == [1, 2, 1]


def test_idle_cores_mean_other_work_is_not_taking_ours() -> None:
    m = FakeMachine()
    g = m.governor(4)  # a big host: others busy, but cores to spare
    for _ in range(4):
        m.run(g, other=6.0, idle=8.0, ours=4.0)
    assert m.set_to == []


def test_a_changing_load_does_not_flap() -> None:
    m = FakeMachine()
    g = m.governor(2)
    for other in (0.8, 0.1, 0.8, 0.1, 0.8, 0.1):  # alternating windows never agree twice
        m.run(g, other=other, idle=0.0)
    assert m.set_to == []


def test_governor_samples_once_a_period() -> None:
    m = FakeMachine()
    g = m.governor(2)
    for _ in range(10):  # ten steps within one period: no sample, no change
        g.wrap(lambda: m.advance(1.5, 0.0, 0.5, 0.01))()
    assert m.set_to == [] and m.now < 0.5


def test_current_cpu_is_field_39_of_the_thread_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    rest = " ".join(["0"] * 35)  # fields 4..38
    stat.write_text(f"4321 (a (tricky) name) R {rest} 7 0 0\n")
    assert current_cpu(stat) == 7
    assert current_cpu(tmp_path / "gone") is None
    assert current_cpu() in os.sched_getaffinity(0)  # this machine's own


class FakeThread:
    """Records thread counts and affinity masks in the order they were set."""

    def __init__(self, cpu: int | None) -> None:
        self.cpu = cpu
        self.calls: list[tuple[str, object]] = []

    def placement(self, cpus: set[int]) -> ThreadPlacement:
        return ThreadPlacement(
            lambda n: self.calls.append(("count", n)),
            cpus,
            set_affinity=lambda pid, mask: self.calls.append(("mask", sorted(mask))),
            where=lambda: self.cpu,
        )


def test_a_lone_thread_is_bound_where_it_runs_and_freed_before_threads_return() -> None:
    t = FakeThread(cpu=3)
    place = t.placement({2, 3})
    place(1)
    assert t.calls == [("count", 1), ("mask", [3])] and place.pinned == 3
    t.calls.clear()
    place(2)  # the whole mask first: threads OpenMP starts now must not inherit CPU 3 alone
    assert t.calls == [("mask", [2, 3]), ("count", 2)] and place.pinned is None
    t.calls.clear()
    place(2)  # nothing bound: only the count
    assert t.calls == [("count", 2)]


def test_no_binding_off_the_mask_unknown_or_with_one_cpu() -> None:
    for cpu, cpus in ((5, {0, 1}), (None, {0, 1}), (0, {0})):
        t = FakeThread(cpu)
        place = t.placement(cpus)
        place(1)
        assert t.calls == [("count", 1)] and place.pinned is None


def test_the_binding_has_its_own_switch() -> None:
    assert switched_off({"SHARDSERVE_BIND_THREAD": "off"}, "SHARDSERVE_BIND_THREAD")
    assert not switched_off({"SHARDSERVE_BIND_THREAD": "off"})  # the governor stays on
    assert not switched_off({}, "SHARDSERVE_BIND_THREAD")


def test_a_refused_mask_leaves_the_thread_as_it_was() -> None:
    counts: list[int] = []

    def refuse(pid: int, mask: set[int]) -> None:
        raise OSError(22, "Invalid argument")

    place = ThreadPlacement(counts.append, {0, 1}, set_affinity=refuse, where=lambda: 1)
    place(1)
    assert counts == [1] and place.pinned is None
