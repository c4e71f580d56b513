"""Start replicas from the parent's side: validate, plan data parallelism, spawn and stop ranks.

:func:`start_replicas` spawns ``dp`` replicas on this machine as children of
the caller (``shardserve serve``); :func:`start_replica` spawns one. Each of a
replica's ``tp * pp`` rank processes runs :func:`model_shards.launch.rank_process.run_rank`
(what runs inside a rank lives there, with the torchrun entry point); they die
with this process (``PR_SET_PDEATHSIG``) and are stopped by
:meth:`ReplicaHandle.stop`.

Importing this module initialises no CUDA and loads none of a rank's machinery
(coordinator, workers, models, process groups): the frontend imports it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess

from model_shards.config.encoder import EncoderConfig
from model_shards.config.model import ModelConfig
from model_shards.config.replica import KV_FP8_ON_CPU, ReplicaConfig, ranks_use_gpus
from model_shards.launch.cpu_budget import CpuBudget, ThreadPlan, detect_budget, plan_threads
from model_shards.launch.rank_process import run_rank
from model_shards.worker.open_checkpoint import verify_checkpoint

log = logging.getLogger(__name__)


def validate_replica(
    config: ReplicaConfig, local_world_size: int | None = None
) -> ModelConfig | EncoderConfig:
    """Every start-up check that needs no spawned process; ``ValueError`` names the flag.

    ``local_world_size``: ranks on this machine (default: all ``tp * pp``).
    """
    model = config.validate()
    if isinstance(model, ModelConfig):  # the family's own config.json fields
        from model_shards.models import MODEL_REGISTRY

        family = MODEL_REGISTRY[model.architecture]
        family.check_config(model, config.resolved_max_model_len(model))
    verify_checkpoint(config.model_dir)
    if config.device != "cpu":
        from model_shards.parallel.state import choose_backend

        backend = choose_backend(local_world_size or config.world_size, config.device)
        if backend != "nccl" and config.kv_cache_dtype == "fp8":
            raise ValueError(KV_FP8_ON_CPU)  # --device auto without GPUs
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ReplicaHandle:
    """The rank processes of one replica this process spawned (rank ``i`` is ``processes[i]``).

    ``config`` and ``gpus`` are what :meth:`respawn` starts again after a failure.
    """

    address: str
    processes: list[BaseProcess]
    _tmpdir: str | None = field(default=None, repr=False)
    config: ReplicaConfig | None = field(default=None, repr=False)
    gpus: list[str] | None = field(default=None, repr=False)
    environment: dict[str, str] | None = field(default=None, repr=False)

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.processes]

    def pids(self) -> list[int | None]:
        """Each rank's process id, by rank."""
        return [p.pid for p in self.processes]

    def death(self) -> str | None:
        """``None`` while every rank runs, else e.g. ``"rank 3 killed by SIGKILL"``.

        Names the first rank killed by a signal (the cause: its peers exit with an error after
        it), else the first dead rank (in rank order), and how it ended.
        """
        dead = [(rank, p) for rank, p in enumerate(self.processes) if not p.is_alive()]
        signalled = [(rank, p) for rank, p in dead if p.exitcode is not None and p.exitcode < 0]
        for rank, p in signalled or dead:
            return f"rank {rank} (pid {p.pid}) {describe_exit(p.exitcode)}"
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` for ranks to exit, then SIGTERM, then SIGKILL. Idempotent.

        ``timeout=0`` tears a failed replica down at once; every rank is reaped on return.
        """
        for p in self.processes:
            p.join(timeout)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.processes if p.is_alive()]
            for p in alive:
                if p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, sig)
            for p in alive:
                p.join(5)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def respawn(self) -> ReplicaHandle:
        """Stop every rank at once (:meth:`stop` with ``timeout=0``) and start the same replica.

        The new handle has a fresh address; ``ValueError`` if this handle has no config.
        """
        if self.config is None:
            raise ValueError("this replica was not started by start_replica; cannot respawn it")
        self.stop(timeout=0)
        return start_replica(self.config, gpus=self.gpus, environment=self.environment)


def describe_exit(exitcode: int | None) -> str:
    """How a process ended: ``running``, ``exited with code N`` or ``killed by SIGNAME``."""
    if exitcode is None:
        return "running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exited with code {exitcode}"


def cpu_thread_plan(config: ReplicaConfig, dp: int, cpu_count: float | None = None) -> ThreadPlan:
    """Threads per rank for ``dp`` CPU replicas of ``config`` beside this frontend
    (:func:`~model_shards.launch.cpu_budget.plan_threads`); ``cpu_count``: the usable cores
    (default: detected from the affinity mask and the cgroup quota)."""
    if cpu_count is None:
        budget = detect_budget()
    else:
        budget = CpuBudget(math.ceil(cpu_count), float(cpu_count), "given")
    return plan_threads(budget, dp * config.world_size, config.threads_per_rank)


def plan_data_parallel(
    config: ReplicaConfig, dp: int, cpu_count: float | None = None, gpu_count: int = 0
) -> list[tuple[ReplicaConfig, list[int] | None]]:
    """Each replica's config and GPU ids (``None``: CPU) for ``dp`` replicas on this machine.

    With ``dp > 1``, GPUs go to replicas in contiguous slices of ``tp * pp``
    (indices into the visible devices) when there are enough for all of them;
    too few is an error naming the flags, with ``--device auto`` too (a machine
    with GPUs never silently serves on its CPU). CPU replicas split the usable
    cores (``cpu_count``, default detected) with the frontend: :func:`cpu_thread_plan`.
    """
    if dp < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {dp}")
    world = config.world_size
    ranks = dp * world
    use_gpus = ranks_use_gpus(config.device, ranks, gpu_count, f"dp*tp*pp = {ranks}")
    if not use_gpus and config.kv_cache_dtype == "fp8":
        raise ValueError(KV_FP8_ON_CPU)
    if not use_gpus:
        threads = cpu_thread_plan(config, dp, cpu_count).threads_per_rank
        cpu_config = replace(config, threads_per_rank=threads, device="cpu")
        return [(cpu_config, None) for _ in range(dp)]
    if dp == 1:
        return [(config, None)]  # the ranks see what this process sees
    return [(config, list(range(r * world, (r + 1) * world))) for r in range(dp)]


def start_replicas(config: ReplicaConfig, dp: int = 1) -> list[ReplicaHandle]:
    """Validate once, then spawn ``dp`` replicas; each listens on its own ``ipc://`` address.

    ``ValueError`` (naming the flag) before anything is spawned. If starting a
    later replica fails, the ones already started are stopped. ``--dp-attention`` worlds are
    :func:`~model_shards.launch.dp_attention.start_dp_attention`'s.
    """
    validate_replica(config)
    gpu_count = 0
    if config.device != "cpu":
        import torch

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = plan_data_parallel(config, dp, None, gpu_count)
    environment = None
    if plan[0][0].device == "cpu":
        threads = cpu_thread_plan(config, dp)
        log.info("%s", threads.describe())
        environment = threads.wait_environment(os.environ)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else [str(i) for i in range(gpu_count)]
    handles: list[ReplicaHandle] = []
    try:
        for replica_config, gpus in plan:
            ids = [physical[i] for i in gpus] if gpus is not None else None
            handles.append(start_replica(replica_config, gpus=ids, environment=environment))
    except BaseException:
        for handle in handles:
            handle.stop()
        raise
    return handles


def start_replica(
    config: ReplicaConfig,
    address: str | None = None,
    *,
    gpus: list[str] | None = None,
    environment: Mapping[str, str] | None = None,
) -> ReplicaHandle:
    """Validate, spawn the ranks, return at once; rank 0 answers ``Hello`` when loaded.

    ``address`` defaults to a fresh ``ipc://`` path; ``gpus`` (one device id
    or UUID per rank) become each rank's ``CUDA_VISIBLE_DEVICES``; ``environment``:
    variables the ranks start with (the thread plan's wait policy, from
    :func:`start_replicas`), beside :func:`rank_environment`'s.
    """
    validate_replica(config)
    tmpdir = None
    if address is None:
        tmpdir = tempfile.mkdtemp(prefix="shardserve-")
        address = f"ipc://{tmpdir}/engine"
    ctx = mp.get_context("spawn")
    port = free_port()
    visible = ",".join(map(str, gpus)) if gpus is not None else None
    procs: list[BaseProcess] = []
    extra = dict(environment or {})
    with environment_with({**rank_environment(os.environ), **extra}):
        for rank in range(config.world_size):
            p = ctx.Process(
                target=run_rank,
                args=(rank, config, "127.0.0.1", port, address, visible),
                name=f"shardserve-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
    kept_gpus = list(gpus) if gpus is not None else None
    return ReplicaHandle(address, procs, tmpdir, config, kept_gpus, extra)


# glibc (2.35+) backs malloc's large areas with transparent huge pages: every decode step
# streams all the weights, and with 2 MiB pages it takes ~2% less time (fewer TLB misses).
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def rank_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables a rank process starts with beyond the parent's: the huge-page malloc
    tunable, unless ``GLIBC_TUNABLES`` is already set (the user's choice wins)."""
    return {} if "GLIBC_TUNABLES" in environ else {"GLIBC_TUNABLES": HUGE_PAGE_TUNABLE}


@contextlib.contextmanager
def environment_with(extra: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` plus ``extra`` while spawning (a child copies it), then as it was."""
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
