"""What runs inside a rank process: join the replica's world, load this rank's shard, serve.

Two entry points, one body (:func:`serve_rank`):

* :func:`run_rank`: the target of each process :func:`model_shards.launch.replicas.start_replica`
  spawns (``shardserve serve``). It dies with its parent (``PR_SET_PDEATHSIG``)
  and joins the world with ``tcp://127.0.0.1:<port>``.
* :func:`run_torchrun_rank`: each ``torchrun`` worker (``shardserve engine``,
  possibly over several nodes); it joins the world at ``MASTER_ADDR``/``MASTER_PORT``
  from the variables torchrun sets (:class:`TorchrunRank`), torchrun's rank 0 hosting
  the store (bound to ``MASTER_ADDR``, :mod:`model_shards.launch.torchrun_agent`).

Rank 0 runs the :class:`~model_shards.engine.coordinator.Coordinator` (and stage 0,
TP slot 0) on a ZMQ ROUTER at the replica's address; every other rank runs
:meth:`Worker.serve_forever`.

torch and the rank's machinery are imported inside the functions: the parent
imports this module for the spawn target and must not pay for them, and a
spawned rank sets its death signal and ``CUDA_VISIBLE_DEVICES`` before they load.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from model_shards.config.encoder import EncoderConfig
from model_shards.config.model import load_model_config
from model_shards.config.replica import ReplicaConfig

if TYPE_CHECKING:
    from model_shards.engine.engine_port import PortSettings
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import ParallelState
    from model_shards.worker.decoder_worker import Worker

log = logging.getLogger(__name__)


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


def start_rank_process(rank: int) -> None:
    """What a spawned rank process does first: die with its parent, leave Ctrl-C to the
    frontend (which stops us), log as ``rank``."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _log_as(rank)


def run_rank(
    rank: int,
    config: ReplicaConfig,
    master_addr: str,
    master_port: int,
    address: str,
    visible_devices: str | None = None,
) -> None:
    """Entry point of a rank process spawned by
    :func:`model_shards.launch.replicas.start_replica`."""
    start_rank_process(rank)
    if visible_devices is not None:  # before CUDA is initialised
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    serve_rank(
        rank,
        config,
        address,
        lambda: _join(
            rank, config, master_addr=master_addr, master_port=master_port, cuda_index=rank
        ),
    )


@dataclass(frozen=True)
class TorchrunRank:
    """This worker's place, from the variables ``torchrun`` sets.

    ``rank`` is the replica rank shardserve uses: ``node_rank * nproc_per_node
    + local index``. torchrun's own ``RANK`` follows the c10d rendezvous,
    which orders nodes by host name and process id, not by ``--node-rank``;
    re-deriving it from ``--node-rank`` puts rank 0 (the coordinator, which
    the frontend connects to) on node 0 every time. The world is the same
    set of processes either way, so ``MASTER_ADDR``/``MASTER_PORT`` from torchrun still
    join it (the store's server is torchrun's rank 0, on the node ``MASTER_ADDR`` names).
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
        missing = [
            k
            for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            if k not in env
        ]
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
    """Entry point of each torchrun worker: join the replica at ``MASTER_ADDR`` and serve.

    Rank 0 binds the ZMQ ROUTER at ``address`` (e.g. ``tcp://0.0.0.0:5555``).
    """
    me = TorchrunRank.from_env(os.environ, node_rank, config.world_size)
    _log_as(me.rank)
    if me.rank != me.torchrun_rank:
        log.info("torchrun rank %d serves as replica rank %d", me.torchrun_rank, me.rank)
    serve_rank(
        me.rank,
        config,
        address,
        lambda: _join(
            me.rank,
            config,
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            hosts_store=me.torchrun_rank == 0,  # on the node MASTER_ADDR names
            cuda_index=me.rank % me.nproc_per_node,
            local_world_size=me.nproc_per_node,
        ),
    )


def _join(rank: int, config: ReplicaConfig, **where: Any) -> ParallelState:
    """Join this replica's world (``where``: the rendezvous and this rank's GPU, see
    :func:`~model_shards.parallel.state.init_parallel`)."""
    from model_shards.parallel.state import init_parallel

    return init_parallel(
        rank,
        config.tp,
        config.pp,
        device=config.device,
        timeout_s=config.collective_timeout_s,
        **where,
    )


def serve_rank(
    rank: int, config: ReplicaConfig, address: str, init: Callable[[], ParallelState]
) -> None:
    """The body every rank runs: join the world (``init``), load this rank's shard, serve.

    Rank 0 runs the coordinator on a ZMQ ROUTER at ``address`` until a
    frontend sends ``Shutdown``; the others follow its step plans.
    """
    import torch

    from model_shards.engine.coordinator import Coordinator
    from model_shards.engine.engine_port import PortSettings
    from model_shards.engine.speculative.draft_model import build_draft
    from model_shards.launch.cpu_budget import default_threads_per_rank
    from model_shards.launch.cpu_governor import govern_threads
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import destroy_parallel
    from model_shards.worker.decoder_worker import Worker

    # rank 0's engine token ($SHARDSERVE_ENGINE_TOKEN): a missing one fails before loading
    settings = PortSettings.from_environment(os.environ) if rank == 0 else None
    threads = config.threads_per_rank or default_threads_per_rank(config.world_size)
    torch.set_num_threads(threads)
    model = load_model_config(config.model_dir)
    max_len = config.resolved_max_model_len(model)
    ps = init()
    comm = Comm.open(ps)
    clean = False
    try:
        if isinstance(model, EncoderConfig):
            _serve_encoder(config, model, comm, address, max_len, settings)
            clean = True
            return
        worker = Worker.build(config, model, comm, max_len)
        govern_threads(worker, threads, ps.device.type)
        _log_loaded(worker)
        if settings is not None:
            Coordinator(
                worker,
                draft=build_draft(config, worker, max_len),
                **_step_limits(config, max_len),
                enable_prefix_caching=config.enable_prefix_caching,
                pipeline_overlap=config.pipeline_overlap,
                model_dir=str(config.model_dir),
                grammar_compile_timeout_s=config.grammar_compile_timeout_s,
                scheduling_policy=config.scheduling_policy,
                speculative=config.speculative,
                async_scheduling=config.async_scheduling,
            ).serve(address, settings)
        else:
            worker.serve_forever()
        clean = True
    finally:
        destroy_parallel(ps if clean else None, comm.close)


def _log_loaded(worker: Worker) -> None:
    ps = worker.ps
    log.info(
        "loaded stage %d/%d tp %d/%d on %s (%s backend, %s): %.1f MiB read; KV cache %d "
        "blocks x %d = %d tokens",
        ps.pp_rank,
        ps.pp_size,
        ps.tp_rank,
        ps.tp_size,
        ps.device,
        worker.ops.name,
        str(worker.dtype).removeprefix("torch."),
        worker.bytes_loaded / 2**20,
        worker.kv.num_blocks,
        worker.kv.block_size,
        worker.kv.num_blocks * worker.kv.block_size,
    )


class _StepLimits(TypedDict):
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


def _step_limits(config: ReplicaConfig, max_len: int) -> _StepLimits:
    """The step limits both coordinators take, from the replica's flags."""
    return _StepLimits(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_len,
    )


def _serve_encoder(
    config: ReplicaConfig,
    model: EncoderConfig,
    comm: Comm,
    address: str,
    max_len: int,
    settings: PortSettings | None,
) -> None:
    """An embedding replica: rank 0 (the one with the port's ``settings``) batches inputs,
    every rank runs its encoder shard."""
    from model_shards.engine.embedding_coordinator import EmbeddingCoordinator
    from model_shards.worker.encoder_worker import EncoderWorker

    worker = EncoderWorker.build(config, model, comm)
    log.info(
        "loaded encoder tp %d/%d: %.1f MiB read",
        comm.ps.tp_rank,
        comm.ps.tp_size,
        worker.bytes_loaded / 2**20,
    )
    if settings is not None:
        EmbeddingCoordinator(worker, **_step_limits(config, max_len)).serve(address, settings)
    else:
        worker.serve_forever()
