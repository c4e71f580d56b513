"""The CPU thread-count decision on fake cgroup trees, and how the planned threads wait."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_shards.config.replica import ReplicaConfig
from model_shards.launch.cpu_budget import (
    GOVERNOR_ENV,
    SHORT_SPIN_COUNT,
    CpuBudget,
    detect_budget,
    plan_threads,
    spin_budget_s,
)
from model_shards.launch.replicas import cpu_thread_plan, plan_data_parallel
from server.cli.args import build_parser
from server.cli.flag_checks import replica_config


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v1_tree(root: Path, group: str, quota: int, period: int = 100_000) -> Path:
    """A cgroup v1 host: this process in ``group`` of the ``cpu,cpuacct`` hierarchy."""
    write(root, "proc/self/cgroup", f"5:memory:/x\n4:cpu,cpuacct:{group}\n0::/\n")
    mount = root / "sys/fs/cgroup/cpu,cpuacct"
    write(mount, "cpu.cfs_quota_us", "-1\n")  # the root group: no limit
    write(mount, "cpu.cfs_period_us", "100000\n")
    write(mount, f"{group.strip('/')}/cpu.cfs_quota_us", f"{quota}\n")
    write(mount, f"{group.strip('/')}/cpu.cfs_period_us", f"{period}\n")
    return mount


def v2_tree(root: Path, group: str, cpu_max: str) -> Path:
    write(root, "proc/self/cgroup", f"0::{group}\n")
    mount = root / "sys/fs/cgroup"
    write(mount, "cgroup.controllers", "cpu memory\n")
    write(mount, f"{group.strip('/')}/cpu.max", cpu_max + "\n")
    return mount


def test_affinity_mask_without_any_cgroup(tmp_path: Path) -> None:
    budget = detect_budget(tmp_path, affinity={0, 3, 5})  # no proc/self/cgroup at all
    assert (budget.affinity, budget.quota, budget.cores) == (3, None, 3.0)
    assert plan_threads(budget, 1).threads_per_rank == 3  # round(2.75)


def test_v1_quota_caps_the_affinity(tmp_path: Path) -> None:
    mount = v1_tree(tmp_path, "/kubepods/pod1", quota=150_000)
    budget = detect_budget(tmp_path, affinity=set(range(8)))
    assert budget.cores == 1.5
    assert budget.quota_source == str(mount / "kubepods/pod1/cpu.cfs_quota_us")
    assert plan_threads(budget, 1).threads_per_rank == 1  # round(1.25)


def test_v1_unlimited_group_keeps_the_affinity(tmp_path: Path) -> None:
    v1_tree(tmp_path, "/build", quota=-1)
    assert detect_budget(tmp_path, affinity={0, 1, 2, 3}).cores == 4.0


def test_v1_ancestor_limit_applies(tmp_path: Path) -> None:
    mount = v1_tree(tmp_path, "/outer/inner", quota=-1)
    write(mount, "outer/cpu.cfs_quota_us", "200000\n")
    write(mount, "outer/cpu.cfs_period_us", "100000\n")
    budget = detect_budget(tmp_path, affinity=set(range(16)))
    assert (budget.cores, budget.quota_source) == (2.0, str(mount / "outer/cpu.cfs_quota_us"))


def test_v2_cpu_max(tmp_path: Path) -> None:
    v2_tree(tmp_path, "/system.slice/app.service", "50000 100000")
    budget = detect_budget(tmp_path, affinity={0, 1})
    assert budget.cores == 0.5
    plan = plan_threads(budget, 1)
    assert plan.threads_per_rank == 1 and plan.fills_cores


def test_v2_max_means_no_quota(tmp_path: Path) -> None:
    v2_tree(tmp_path, "/user.slice", "max 100000")
    budget = detect_budget(tmp_path, affinity=set(range(6)))
    assert (budget.quota, budget.cores) == (None, 6.0)


def test_container_mount_is_its_own_group(tmp_path: Path) -> None:
    """Without a cgroup namespace /proc/self/cgroup names a host path the mount lacks."""
    write(tmp_path, "proc/self/cgroup", "0::/docker/abc123\n")
    mount = tmp_path / "sys/fs/cgroup"
    write(mount, "cgroup.controllers", "cpu\n")
    write(mount, "cpu.max", "100000 100000\n")
    assert detect_budget(tmp_path, affinity={0, 1, 2, 3}).cores == 1.0


def test_frontend_and_every_rank_counted_together() -> None:
    two = CpuBudget(2, None, "test")
    plan = plan_threads(two, 1)
    assert plan.threads_per_rank == 2 and plan.demand == 2.25 and plan.fills_cores
    assert plan_threads(two, 2).threads_per_rank == 1  # tp=2: one thread each
    big = plan_threads(CpuBudget(16, None, "test"), 2)
    assert big.threads_per_rank == 8 and big.fills_cores
    roomy = plan_threads(CpuBudget(16, None, "test"), 3)
    assert roomy.threads_per_rank == 5 and not roomy.fills_cores  # 15.25 of 16


def test_override_wins_and_fixes_the_count(tmp_path: Path) -> None:
    v1_tree(tmp_path, "/g", quota=100_000)
    plan = plan_threads(detect_budget(tmp_path, affinity={0, 1}), 1, override=3)
    assert plan.threads_per_rank == 3 and plan.overridden
    env = plan.wait_environment({})
    assert env[GOVERNOR_ENV] == "0" and env["GOMP_SPINCOUNT"] == str(SHORT_SPIN_COUNT)
    assert "--cpu-threads-per-rank" in plan.describe()


def test_wait_environment() -> None:
    governed = plan_threads(CpuBudget(2, None, "test"), 1)  # 2 threads + the frontend: filled
    assert governed.threads_per_rank == 2 and governed.governed({})
    env = governed.wait_environment({})  # OpenMP's default spins; the governor drops threads
    assert "GOMP_SPINCOUNT" not in env and GOVERNOR_ENV not in env
    assert spin_budget_s(env) == pytest.approx(100e-6)
    fixed = governed.wait_environment({GOVERNOR_ENV: "0"})  # switched off: short spins
    assert fixed["GOMP_SPINCOUNT"] == str(SHORT_SPIN_COUNT) and fixed["KMP_BLOCKTIME"] == "0"
    single = plan_threads(CpuBudget(1, None, "test"), 1)  # one thread: nothing to govern
    assert not single.governed({}) and "GOMP_SPINCOUNT" in single.wait_environment({})
    assert governed.wait_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {}  # the user's choice
    spare = plan_threads(CpuBudget(16, None, "test"), 3)
    assert spare.wait_environment({}) == {} and spin_budget_s({}) is None
    assert "GOMP_SPINCOUNT" in single.describe() and "default" in spare.describe()
    assert "fewer threads" in governed.describe()


def test_launch_plans_from_the_budget() -> None:
    config = ReplicaConfig(model_dir=".", device="cpu")
    assert cpu_thread_plan(config, 1, cpu_count=1.0).threads_per_rank == 1
    [(planned, gpus)] = plan_data_parallel(config, 1, cpu_count=4)
    assert (planned.threads_per_rank, gpus) == (4, None)  # round(3.75)
    fixed = ReplicaConfig(model_dir=".", device="cpu", threads_per_rank=2)
    assert cpu_thread_plan(fixed, 2, cpu_count=16).overridden


def test_cli_flag() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", ".", "--cpu-threads-per-rank", "3"])
    assert replica_config(args).threads_per_rank == 3
    assert replica_config(parser.parse_args(["serve", "--model", "."])).threads_per_rank is None
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["serve", "--cpu-threads-per-rank", bad])
        assert exc.value.code == 2
