"""Spawn a data-parallel-attention world: ``-dp D --enable-expert-parallel --dp-attention``.

One world of ``D`` ranks (tp = 1 each; gloo on CPU): rank ``r`` is replica ``r``'s
coordinator on its own ZMQ address (the frontend connects to it like to an ordinary
replica and routes to it by load), its attention and KV cache its own, and the MoE
layers of all ``D`` ranks form one expert-parallel group (``E / D`` experts each,
all-to-all every sparse layer). The coordinators step in lockstep
(:func:`model_shards.engine.dp_attention.serve_lockstep`); an idle one still joins every step.

Restarts: the ``D`` replicas live and die together. Every collective has the world's
timeout (``collective_timeout_s``), so when one rank dies the others fail and exit
instead of hanging. :meth:`DpAttentionHandle.respawn` (what the supervisor calls for a
dead replica) stops the whole world and starts a new one, once per failure: the
supervisors of the other replicas, seeing theirs die too, get the already restarted
world's handle. Requests in flight on every replica are lost with the old world.

Like :mod:`model_shards.launch.replicas`, importing this module loads no torch.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess

from model_shards.config.model import ModelConfig, load_model_config
from model_shards.config.replica import ReplicaConfig
from model_shards.launch.cpu_budget import detect_budget, plan_threads
from model_shards.launch.replicas import (
    ReplicaHandle,
    environment_with,
    free_port,
    rank_environment,
)

FLAG = "--dp-attention"


def check_dp_attention_flags(
    *, dp: int, tp: int, pp: int, expert_parallel: bool, engines: int
) -> None:
    """The checks on the flags alone; ``ValueError`` naming ``--dp-attention``."""
    if not expert_parallel:
        raise ValueError(f"{FLAG} needs --enable-expert-parallel (the replicas share experts)")
    if dp < 2:
        raise ValueError(f"{FLAG} needs --data-parallel-size >= 2, got {dp}")
    if tp != 1:
        raise ValueError(f"{FLAG} runs each replica at --tensor-parallel-size 1, got {tp}")
    if pp != 1:
        raise ValueError(f"{FLAG} runs each replica at --pipeline-parallel-size 1, got {pp}")
    if engines:
        raise ValueError(f"{FLAG} starts its replicas; it cannot be used with --engine")


def check_dp_attention_args(args: argparse.Namespace) -> None:
    """:func:`check_dp_attention_flags` on ``serve``'s parsed flags."""
    check_dp_attention_flags(
        dp=args.data_parallel_size,
        tp=args.tensor_parallel_size,
        pp=args.pipeline_parallel_size,
        expert_parallel=args.enable_expert_parallel,
        engines=len(args.engine),
    )


def check_dp_attention_model(config: ReplicaConfig, dp: int) -> ModelConfig:
    """The flags' checks, then the model's: a MoE model whose expert count ``dp * tp``
    divides (``ValueError`` naming the flag and the valid sizes)."""
    from model_shards.config.moe import moe_config

    check_dp_attention_flags(
        dp=dp, tp=config.tp, pp=config.pp, expert_parallel=config.enable_expert_parallel, engines=0
    )
    model = load_model_config(config.model_dir)
    moe = moe_config(model) if isinstance(model, ModelConfig) else None
    if not isinstance(model, ModelConfig) or moe is None:
        raise ValueError(f"{FLAG}: {config.model_dir} is not a mixture-of-experts model")
    ranks = dp * config.tp
    if moe.num_experts % ranks:
        valid = [d for d in range(2, moe.num_experts + 1) if moe.num_experts % d == 0]
        raise ValueError(
            f"{FLAG} with --data-parallel-size {dp}: {moe.num_experts} experts do not split "
            f"over {ranks} ranks; valid sizes: {valid}"
        )
    return model


@dataclass(eq=False)
class DpAttentionWorld:
    """The ``dp`` replicas of one world; :meth:`respawn` restarts them together."""

    config: ReplicaConfig
    dp: int
    environment: dict[str, str]
    handles: list[DpAttentionHandle] = field(default_factory=list)
    generation: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start(self) -> None:
        """Spawn the ``dp`` ranks; each gets a fresh ``ipc://`` address."""
        ctx = mp.get_context("spawn")
        port = free_port()
        tmpdir = tempfile.mkdtemp(prefix="shardserve-dpa-")
        handles: list[DpAttentionHandle] = []
        with environment_with({**rank_environment(os.environ), **self.environment}):
            for rank in range(self.dp):
                address = f"ipc://{tmpdir}/engine{rank}"
                p: BaseProcess = ctx.Process(
                    target=run_dp_attention_rank,
                    args=(rank, self.dp, self.config, "127.0.0.1", port, address),
                    name=f"shardserve-dpa-rank{rank}",
                    daemon=True,
                )
                p.start()
                own = tmpdir if rank == 0 else None  # the last stop removes it
                handles.append(
                    DpAttentionHandle(address, [p], own, self.config, world=self, index=rank)
                )
        for h in handles:
            h.generation = self.generation
        self.handles = handles

    def respawn(self, index: int, generation: int) -> DpAttentionHandle:
        """Replica ``index``'s handle in a running world: the world is stopped and started
        again unless that already happened since ``generation``."""
        with self._lock:
            if generation == self.generation:
                for h in self.handles[::-1]:  # rank 0's handle owns the directory
                    h.stop(timeout=0)
                self.generation += 1
                self.start()
            return self.handles[index]


@dataclass(eq=False)
class DpAttentionHandle(ReplicaHandle):
    """One replica (one rank) of a :class:`DpAttentionWorld`."""

    world: DpAttentionWorld | None = field(default=None, repr=False)
    generation: int = 0
    index: int = 0  # its rank in the world

    def respawn(self) -> ReplicaHandle:
        """Restart the whole world (see the module docstring); this replica's new handle."""
        if self.world is None:
            raise ValueError("this replica belongs to no data-parallel attention world")
        return self.world.respawn(self.index, self.generation)


def start_dp_attention(config: ReplicaConfig, dp: int) -> list[ReplicaHandle]:
    """Validate (``ValueError`` naming the flag, nothing spawned), then spawn the world."""
    from model_shards.launch.replicas import validate_replica

    check_dp_attention_model(config, dp)
    validate_replica(config)
    if config.device not in ("cpu", "auto"):
        raise ValueError(f"{FLAG} runs on --device cpu for now, got {config.device}")
    plan = plan_threads(detect_budget(), dp, config.threads_per_rank)
    rank_config = replace(config, device="cpu", threads_per_rank=plan.threads_per_rank)
    world = DpAttentionWorld(rank_config, dp, plan.wait_environment(os.environ))
    world.start()
    return list(world.handles)


def run_dp_attention_rank(
    rank: int, dp: int, config: ReplicaConfig, master_addr: str, master_port: int, address: str
) -> None:
    """A rank process: join the world of ``dp``, load the replica (all but the other
    ranks' experts), serve its frontends in lockstep with the others."""
    from model_shards.launch.rank_process import start_rank_process

    start_rank_process(rank)
    import torch

    from model_shards.engine.engine_port import PortSettings

    settings = PortSettings.from_environment(os.environ)  # before loading anything

    from model_shards.engine.coordinator import Coordinator
    from model_shards.engine.dp_attention import LockstepEngine, serve_lockstep
    from model_shards.engine.speculative.draft_model import build_draft
    from model_shards.parallel.comm import Comm
    from model_shards.parallel.state import destroy_parallel, init_parallel, single_process_state
    from model_shards.worker.decoder_worker import Worker

    torch.set_num_threads(config.threads_per_rank or 1)
    model = load_model_config(config.model_dir)
    assert isinstance(model, ModelConfig)
    max_len = config.resolved_max_model_len(model)
    ps = init_parallel(
        rank,
        dp,  # the expert-parallel group spans the world
        1,
        master_addr=master_addr,
        master_port=master_port,
        device=config.device,
        timeout_s=config.collective_timeout_s,
    )
    ep = Comm.open(ps)
    clean = False
    try:
        worker = Worker.build(config, model, Comm(single_process_state()), max_len, ep_comm=ep)
        coordinator = Coordinator(
            worker,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_len,
            enable_prefix_caching=config.enable_prefix_caching,
            model_dir=str(config.model_dir),
            grammar_compile_timeout_s=config.grammar_compile_timeout_s,
            scheduling_policy=config.scheduling_policy,
            speculative=config.speculative,
            draft=build_draft(config, worker, max_len),
            async_scheduling=False,  # the replicas step in lockstep, one step at a time
        )
        serve_lockstep(LockstepEngine(coordinator, ep), address, settings)
        clean = True
    finally:
        destroy_parallel(ps if clean else None, ep.close)
