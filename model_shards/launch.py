"""Start replicas: validate, then run each replica's ``tp * pp`` rank processes.

Two ways in, one rank body (:func:`serve_rank`):

* :func:`start_replicas` spawns ``dp`` replicas on this machine as children of
  the caller (``shardserve serve``). They die with it (``PR_SET_PDEATHSIG``)
  and are stopped by :meth:`ReplicaHandle.stop`; each rank joins its world
  with ``tcp://127.0.0.1:<free port>`` (:func:`run_rank`).
* :func:`run_torchrun_rank` is what each ``torchrun`` worker runs
  (``shardserve engine``, possibly over several nodes); it joins the world with
  ``env://`` from the variables torchrun sets.

Either way rank 0 runs the :class:`~model_shards.coordinator.Coordinator`
(and stage 0, TP slot 0) on a ZMQ ROUTER at the replica's address; every
other rank runs :meth:`Worker.serve_forever`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from model_shards.checkpoint import verify_checkpoint
from model_shards.config import EncoderConfig, ModelConfig, ReplicaConfig, load_model_config

if TYPE_CHECKING:
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import ParallelState

log = logging.getLogger(__name__)


def validate_replica(
    config: ReplicaConfig, local_world_size: int | None = None
) -> ModelConfig | EncoderConfig:
    """Every start-up check that needs no spawned process; ``ValueError`` names the flag.

    ``local_world_size``: ranks on this machine (default: all ``tp * pp``).
    """
    model = config.validate()
    verify_checkpoint(config.model_dir)
    if config.device != "cpu":
        from model_shards.parallel.state import choose_backend

        choose_backend(local_world_size or config.world_size, config.device)
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

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.processes]

    def pids(self) -> list[int | None]:
        """Each rank's process id, by rank."""
        return [p.pid for p in self.processes]

    def death(self) -> str | None:
        """``None`` while every rank runs, else e.g. ``"rank 3 killed by SIGKILL"``.

        Names the first dead rank (in rank order) and how it ended.
        """
        for rank, p in enumerate(self.processes):
            if not p.is_alive():
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
        return start_replica(self.config, gpus=self.gpus)


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


def plan_data_parallel(
    config: ReplicaConfig, dp: int, cpu_count: int | None = None, gpu_count: int = 0
) -> list[tuple[ReplicaConfig, list[int] | None]]:
    """Each replica's config and GPU ids (``None``: CPU) for ``dp`` replicas on this machine.

    With ``dp > 1``, GPUs go to replicas in contiguous slices of ``tp * pp``
    (indices into the visible devices) when there are enough for all of them;
    too few is an error naming the flags, with ``--device auto`` too (a machine
    with GPUs never silently serves on its CPU). CPU replicas split the cores:
    ``threads_per_rank`` defaults to ``cores // (dp * tp * pp)``, at least 1.
    """
    if dp < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {dp}")
    world = config.world_size
    use_gpus = config.device != "cpu" and gpu_count >= dp * world
    if config.device != "cpu" and not use_gpus and (config.device == "cuda" or gpu_count):
        raise ValueError(
            f"--device {config.device} needs one GPU per rank: dp*tp*pp = {dp * world} but "
            f"{gpu_count} CUDA device(s) are visible; lower -dp/-tp/-pp or pass --device cpu "
            f"to serve on CPU"
        )
    if not use_gpus:
        threads = config.threads_per_rank or max(1, (cpu_count or 1) // (dp * world))
        cpu_config = replace(config, threads_per_rank=threads, device="cpu")
        return [(cpu_config, None) for _ in range(dp)]
    if dp == 1:
        return [(config, None)]  # the ranks see what this process sees
    return [(config, list(range(r * world, (r + 1) * world))) for r in range(dp)]


def start_replicas(config: ReplicaConfig, dp: int = 1) -> list[ReplicaHandle]:
    """Validate once, then spawn ``dp`` replicas; each listens on its own ``ipc://`` address.

    ``ValueError`` (naming the flag) before anything is spawned. If starting a
    later replica fails, the ones already started are stopped.
    """
    validate_replica(config)
    gpu_count = 0
    if config.device != "cpu":
        import torch

        gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = plan_data_parallel(config, dp, os.cpu_count(), gpu_count)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",") if visible else [str(i) for i in range(gpu_count)]
    handles: list[ReplicaHandle] = []
    try:
        for replica_config, gpus in plan:
            ids = [physical[i] for i in gpus] if gpus is not None else None
            handles.append(start_replica(replica_config, gpus=ids))
    except BaseException:
        for handle in handles:
            handle.stop()
        raise
    return handles


def start_replica(
    config: ReplicaConfig, address: str | None = None, *, gpus: list[str] | None = None
) -> ReplicaHandle:
    """Validate, spawn the ranks, return at once; rank 0 answers ``Hello`` when loaded.

    ``address`` defaults to a fresh ``ipc://`` path; ``gpus`` (one device id
    or UUID per rank) become each rank's ``CUDA_VISIBLE_DEVICES``.
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
    with _environment(rank_environment(os.environ)):
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
    return ReplicaHandle(address, procs, tmpdir, config, kept_gpus)


# glibc (2.35+) backs malloc's large areas with transparent huge pages: every decode step
# streams all the weights, and with 2 MiB pages it takes ~2% less time (fewer TLB misses).
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"


def rank_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Variables a rank process starts with beyond the parent's: the huge-page malloc
    tunable, unless ``GLIBC_TUNABLES`` is already set (the user's choice wins)."""
    return {} if "GLIBC_TUNABLES" in environ else {"GLIBC_TUNABLES": HUGE_PAGE_TUNABLE}


@contextlib.contextmanager
def _environment(extra: Mapping[str, str]) -> Iterator[None]:
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


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _log_as(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s"
    )


def run_rank(
    rank: int, config: ReplicaConfig, master_addr: str, master_port: int, address: str,
    visible_devices: str | None = None,
) -> None:  # fmt: skip
    """Entry point of a rank process spawned by :func:`start_replica`."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the frontend, which stops us
    if visible_devices is not None:  # before CUDA is initialised
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    _log_as(rank)
    from model_shards.parallel.state import init_parallel

    serve_rank(
        rank, config, address,
        lambda: init_parallel(
            rank, config.tp, config.pp, master_addr=master_addr, master_port=master_port,
            device=config.device, timeout_s=config.collective_timeout_s, cuda_index=rank,
        ),
    )  # fmt: skip


@dataclass(frozen=True)
class TorchrunRank:
    """This worker's place, from the variables ``torchrun`` sets.

    ``rank`` is the replica rank shardserve uses: ``node_rank * nproc_per_node
    + local index``. torchrun's own ``RANK`` follows the c10d rendezvous,
    which orders nodes by host name and process id, not by ``--node-rank``;
    re-deriving it from ``--node-rank`` puts rank 0 (the coordinator, which
    the frontend connects to) on node 0 every time. The world is the same
    set of processes either way, so ``env://`` (``MASTER_ADDR``/``MASTER_PORT``
    from torchrun) still joins it.
    """

    rank: int
    world_size: int
    nproc_per_node: int
    torchrun_rank: int

    @staticmethod
    def from_env(env: Mapping[str, str], node_rank: int, world_size: int) -> TorchrunRank:
        """Read ``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``PORT``.

        ``ValueError`` when a variable is missing or the world is not ``world_size``.
        """
        missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                               "MASTER_PORT") if k not in env]  # fmt: skip
        if missing:
            raise ValueError(f"not started by torchrun: {', '.join(missing)} unset")
        torchrun_rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        nproc = int(env["LOCAL_WORLD_SIZE"])
        if world != world_size:
            raise ValueError(
                f"torchrun started {world} processes but the replica has tp*pp = {world_size}; "
                f"use --nnodes N --nproc-per-node tp*pp/N"
            )
        rank = node_rank * nproc + torchrun_rank % nproc
        if not 0 <= rank < world:
            raise ValueError(f"--node-rank {node_rank} out of range for {world // nproc} nodes")
        return TorchrunRank(rank, world, nproc, torchrun_rank)


def run_torchrun_rank(config: ReplicaConfig, address: str, node_rank: int) -> None:
    """Entry point of each torchrun worker: join the replica with ``env://`` and serve.

    Rank 0 binds the ZMQ ROUTER at ``address`` (e.g. ``tcp://0.0.0.0:5555``).
    """
    me = TorchrunRank.from_env(os.environ, node_rank, config.world_size)
    _log_as(me.rank)
    if me.rank != me.torchrun_rank:
        log.info("torchrun rank %d serves as replica rank %d", me.torchrun_rank, me.rank)
    from model_shards.parallel.state import init_parallel

    serve_rank(
        me.rank, config, address,
        lambda: init_parallel(
            me.rank, config.tp, config.pp, master_addr=None, master_port=None,
            device=config.device, timeout_s=config.collective_timeout_s,
            cuda_index=me.rank % me.nproc_per_node, local_world_size=me.nproc_per_node,
        ),
    )  # fmt: skip


def serve_rank(
    rank: int, config: ReplicaConfig, address: str, init: Callable[[], ParallelState]
) -> None:
    """The body every rank runs: join the world (``init``), load this rank's shard, serve.

    Rank 0 runs the coordinator on a ZMQ ROUTER at ``address`` until a
    frontend sends ``Shutdown``; the others follow its step plans.
    """
    import torch

    from model_shards.coordinator import Coordinator
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import destroy_parallel
    from model_shards.worker import Worker

    threads = config.threads_per_rank or max(1, (os.cpu_count() or 1) // config.world_size)
    torch.set_num_threads(threads)
    model = load_model_config(config.model_dir)
    max_len = config.resolved_max_model_len(model)
    ps = init()
    peers = Comm.open(ps)
    clean = False
    try:
        if isinstance(model, EncoderConfig):
            _serve_encoder(rank, config, model, peers, address, max_len)
            clean = True
            return
        worker = Worker.build(config, model, peers, max_len)
        log.info(
            "loaded stage %d/%d tp %d/%d on %s (%s backend, %s): %.1f MiB read; KV cache %d "
            "blocks x %d = %d tokens",
            ps.pp_rank, ps.pp_size, ps.tp_rank, ps.tp_size, ps.device, worker.ops.name,
            str(worker.dtype).removeprefix("torch."), worker.bytes_loaded / 2**20,
            worker.kv.num_blocks, worker.kv.block_size, worker.kv.num_blocks * worker.kv.block_size,
        )  # fmt: skip
        if rank == 0:
            Coordinator(
                worker,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_len,
                enable_prefix_caching=config.enable_prefix_caching,
                pipeline_overlap=config.pipeline_overlap,
            ).serve(address)
        else:
            worker.serve_forever()
        clean = True
    finally:
        destroy_parallel(ps if clean else None, peers.close)


def _serve_encoder(
    rank: int, config: ReplicaConfig, model: EncoderConfig, peers: Comm, address: str,
    max_len: int,
) -> None:  # fmt: skip
    """An embedding replica: rank 0 batches inputs, every rank runs its encoder shard."""
    from model_shards.embedding_coordinator import EmbeddingCoordinator
    from model_shards.encoder_worker import EncoderWorker

    worker = EncoderWorker.build(config, model, peers)
    log.info("loaded encoder tp %d/%d: %.1f MiB read", peers.ps.tp_rank, peers.ps.tp_size,
             worker.bytes_loaded / 2**20)  # fmt: skip
    if rank == 0:
        EmbeddingCoordinator(
            worker,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_len,
        ).serve(address)
    else:
        worker.serve_forever()
