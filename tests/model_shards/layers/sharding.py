"""Sharded layers against their unsharded tensors: a full tensor read like a checkpoint's,
and a rank's shard context."""

from __future__ import annotations

from dataclasses import replace

import torch

from model_shards.backends import ReferenceBackend
from model_shards.layers.context import ShardContext
from model_shards.parallel.comm import Comm
from model_shards.parallel.state import single_process_state


class FullTensor:
    """A checkpoint tensor held in memory, read like :class:`TensorSource`."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name, self.tensor = name, tensor
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype

    def read(self, dim: int = 0, start: int = 0, end: int | None = None) -> torch.Tensor:
        end = self.shape[dim] if end is None else end
        return self.tensor.narrow(dim, start, end - start).clone()


def shard_context(rank: int, tp: int) -> ShardContext:
    ps = replace(single_process_state(), tp_rank=rank, tp_size=tp)
    return ShardContext(Comm(ps), ReferenceBackend(), torch.float32)
