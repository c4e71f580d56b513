"""RMSNorm over the whole output of a head-split projection (OLMo 2's QK-norm).

OLMo 2 normalizes the full q projection ``x: [T, N]``, ``N = n_heads * D``, with one
statistic per token (and k likewise with ``n_kv_heads``), before RoPE::

    y = w * x / sqrt(sum_j x_j^2 / N + eps)

Partition: ``x`` and ``w`` are split like the column-parallel projection they follow
(:class:`~model_shards.layers.linear.QKVParallelLinear`), by heads over the ``tp`` ranks:

* ``tp`` divides ``n_heads``: rank ``r`` holds heads ``[r n/tp, (r + 1) n/tp)``, i.e.
  columns ``[r N/tp, (r + 1) N/tp)`` of ``x`` and ``w``;
* ``tp > n_heads`` (``n_heads`` divides ``tp``: replicated KV heads): head
  ``r // (tp / n_heads)`` sits on ``tp / n_heads`` consecutive ranks, each holding the
  same ``D`` columns of ``w``.

Reduction: each rank sums the squares of its columns in float32 (``[T, 1]``) and one
``tp_all_reduce`` adds the ranks' sums. Under replication only the first replica of each
head (``tp_rank % replicas == 0``) contributes; the others contribute zeros, so every
head is counted exactly once (rather than ``replicas`` times and divided back, which is
inexact when ``replicas`` is not a power of two). Then, as Hugging Face's
``Olmo2RMSNorm`` rounds, ``y = (w * (x * rsqrt(total / N + eps))).to(x.dtype)``: the
weight is applied in float32 and the result rounded once. At ``tp = 1`` there is no
communication and the result is ``Olmo2RMSNorm``'s.

The math is plain PyTorch in float32 on whatever device ``x`` lives on: it has no
backend op of its own (the collective sits between the statistic and the scaling).
"""

from __future__ import annotations

import torch
from torch import nn

from model_shards.layers.context import ShardContext
from model_shards.layers.linear import check_dim, copy_checked, set_weight_loader
from model_shards.parallel.comm import tp_all_reduce
from model_shards.worker.checkpoint import TensorSource


class ShardedRMSNorm(nn.Module):
    """``x: [T, local]`` (this rank's heads of a ``[T, n_heads * head_dim]`` projection)
    → ``[T, local]``, normalized by the statistics of the full projection."""

    def __init__(self, n_heads: int, head_dim: int, eps: float, ctx: ShardContext) -> None:
        super().__init__()
        ps = ctx.ps
        tp = ps.tp_size
        if n_heads % tp and tp % n_heads:
            raise ValueError(f"{n_heads} heads cannot be split over tp={tp}")
        self.ctx = ctx
        self.eps = eps
        self.full_size = n_heads * head_dim
        self.local_size = max(1, n_heads // tp) * head_dim
        replicas = max(1, tp // n_heads)
        self.shard = ps.tp_rank // replicas  # which slice of the full projection
        self.counted = ps.tp_rank % replicas == 0  # the first replica contributes its sum
        self.weight = nn.Parameter(torch.ones(self.local_size, dtype=ctx.dtype), False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        check_dim(source, 0, self.full_size)
        start = self.shard * self.local_size
        copy_checked(param.data, source.read(0, start, start + self.local_size), source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # [T, local]
        sum_sq = x32.pow(2).sum(-1, keepdim=True)  # [T, 1] this rank's share
        if not self.counted:
            sum_sq = torch.zeros_like(sum_sq)  # a replica: its twin already counts it
        total = tp_all_reduce(sum_sq, self.ctx.comm)  # [T, 1] over all N columns
        y = x32 * torch.rsqrt(total / self.full_size + self.eps)  # [T, local]
        return (self.weight * y).to(x.dtype)
