"""What every layer of a rank is built with: how it talks to the other ranks, which
backend computes its ops, and the dtype of its parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_shards.backends.base import Backend
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import ParallelState, single_process_state


@dataclass(frozen=True)
class ShardContext:
    comm: Comm  # collectives (no-ops at group size 1)
    ops: Backend  # chosen once per worker (model_shards.backends.select_backend)
    dtype: torch.dtype
    # MoE layers: each TP rank holds whole experts (E / tp of them) instead of a slice of
    # every expert (--enable-expert-parallel; see model_shards.config.moe)
    expert_parallel: bool = False
    # data-parallel attention: the group of every replica's rank whose MoE layers exchange
    # tokens (all-to-all); ``comm`` is then this replica's own (tp = 1)
    ep_comm: Comm | None = None
    # --quantization (q8_0 | q4_0): linear and vocab weights quantized as they load
    # (model_shards.layers.loading); None: dense checkpoints stay dense
    quantization: str | None = None

    @property
    def ps(self) -> ParallelState:
        """This rank's place in the replica (TP/PP ranks and sizes)."""
        return self.comm.ps

    @staticmethod
    def single_process(
        ops: Backend, dtype: torch.dtype = torch.float32, device: torch.device | None = None
    ) -> ShardContext:
        """A world of one rank (tests, tools): every collective is a no-op."""
        return ShardContext(Comm(single_process_state(device)), ops, dtype)
