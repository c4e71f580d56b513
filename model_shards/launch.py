"""Start one replica: validate, then spawn its ``tp * pp`` rank processes.

Rank 0 runs the :class:`~model_shards.coordinator.Coordinator` (and stage 0,
TP slot 0); every other rank runs :meth:`Worker.serve_forever`. All ranks are
children of the caller, die with it (``PR_SET_PDEATHSIG``) and are stopped by
:meth:`ReplicaHandle.stop`.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

from model_shards.checkpoint import verify_checkpoint
from model_shards.config import ModelConfig, ReplicaConfig

log = logging.getLogger(__name__)


def validate_replica(config: ReplicaConfig) -> ModelConfig:
    """Every start-up check that needs no spawned process; ``ValueError`` names the flag."""
    model = config.validate()
    verify_checkpoint(config.model_dir)
    if config.device != "cpu":
        from model_shards.parallel.state import choose_backend

        choose_backend(config.world_size, config.device)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ReplicaHandle:
    address: str
    processes: list[BaseProcess]
    _tmpdir: str | None = field(default=None, repr=False)

    def is_alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self.processes]

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to ``timeout`` for ranks to exit, then SIGTERM, then SIGKILL. Idempotent."""
        for p in self.processes:
            p.join(timeout)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.processes if p.is_alive()]
            for p in alive:
                if p.pid is not None:
                    os.kill(p.pid, sig)
            for p in alive:
                p.join(5)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def start_replica(config: ReplicaConfig, address: str | None = None) -> ReplicaHandle:
    """Validate, spawn the ranks, return at once; rank 0 answers ``Hello`` when loaded."""
    validate_replica(config)
    tmpdir = None
    if address is None:
        tmpdir = tempfile.mkdtemp(prefix="shardserve-")
        address = f"ipc://{tmpdir}/engine"
    ctx = mp.get_context("spawn")
    port = free_port()
    procs: list[BaseProcess] = []
    for rank in range(config.world_size):
        p = ctx.Process(
            target=run_rank,
            args=(rank, config, "127.0.0.1", port, address),
            name=f"shardserve-rank{rank}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    return ReplicaHandle(address, procs, tmpdir)


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_rank(
    rank: int, config: ReplicaConfig, master_addr: str, master_port: int, address: str
) -> None:
    """Entry point of every rank process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the frontend, which stops us
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s"
    )
    import torch

    from model_shards.coordinator import Coordinator
    from model_shards.parallel.state import destroy_parallel, init_parallel
    from model_shards.worker import Worker

    threads = config.threads_per_rank or max(1, (os.cpu_count() or 1) // config.world_size)
    torch.set_num_threads(threads)
    model = ModelConfig.from_dir(config.model_dir)
    max_len = config.resolved_max_model_len(model)
    ps = init_parallel(
        rank, config.tp, config.pp, master_addr=master_addr, master_port=master_port,
        device=config.device, timeout_s=config.collective_timeout_s,
    )  # fmt: skip
    try:
        worker = Worker.build(config, model, ps, max_len)
        log.info(
            "loaded stage %d/%d tp %d/%d: %.1f MiB read; KV cache %d blocks x %d = %d tokens",
            ps.pp_rank, ps.pp_size, ps.tp_rank, ps.tp_size, worker.bytes_loaded / 2**20,
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
    finally:
        destroy_parallel()
