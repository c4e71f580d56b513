"""Tensor-parallel linear layers whose checkpoint stores ``W^T`` (HF ``Conv1D``, GPT-2).

HF's ``Conv1D(nf, nx)`` computes ``Y = X A + b`` with ``A: [in, out]``: the transpose of
an ``nn.Linear`` weight. These layers hold ``W = A^T: [out, in]`` like every other
linear layer (:mod:`model_shards.layers.linear`: same partition, same GEMM, same
packing); only their loaders differ, and each rank still reads only its slice:

* column parallel (``mlp.c_fc``): rank ``r`` reads its columns ``A[:, r*o:(r+1)*o]``
  (``source.read(1, …)``) and stores their transpose; the bias slice is ``b[r*o:(r+1)*o]``.
* fused Q/K/V (``attn.c_attn``, ``A = [A_q | A_k | A_v]: [H, (nh + 2 nkv) D]``): rank
  ``r`` reads its heads' columns of each of the three parts, exactly as
  :class:`~model_shards.layers.linear.QKVParallelLinear` splits separate q/k/v tensors.
* row parallel (``c_proj``): rank ``r`` reads its rows ``A[r*i:(r+1)*i, :]`` (one
  contiguous read) and stores their transpose; the bias is whole on every rank.

A checkpoint slice of the wrong shape is a ``CheckpointError`` naming the tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from model_shards.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    check_dim,
    copy_checked,
)
from model_shards.worker.checkpoint import CheckpointError, TensorSource


def _out_slice(source: TensorSource, start: int, end: int) -> torch.Tensor:
    """Output features ``start:end`` of a Conv1D tensor, PyTorch-style: a weight
    ``A: [in, out]`` → ``A[:, start:end]^T: [end - start, in]``; a bias ``[out]`` → its slice."""
    if len(source.shape) == 2:
        return source.read(1, start, end).t()
    if len(source.shape) == 1:
        return source.read(0, start, end)
    raise CheckpointError(f"tensor {source.name!r}: shape {list(source.shape)} is not 1-D or 2-D")


def _out_dim(source: TensorSource) -> int:
    """The output-feature dim of a Conv1D weight (1) or bias (0)."""
    return 1 if len(source.shape) == 2 else 0


class Conv1DColumnParallelLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` loaded from a Conv1D ``[in, out]`` weight and an ``[out]``
    bias."""

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        start = self.ps.tp_rank * self.out_local
        check_dim(source, _out_dim(source), self.out_local * self.ps.tp_size)
        copy_checked(param.data, _out_slice(source, start, start + self.out_local), source.name)


class Conv1DQKVParallelLinear(QKVParallelLinear):
    """:class:`QKVParallelLinear` loaded from one fused Conv1D ``c_attn`` tensor
    (``[H, (nh + 2 nkv) D]`` weight, ``[(nh + 2 nkv) D]`` bias, parts in q, k, v order)."""

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, source: TensorSource
    ) -> None:
        hd, tp, tp_rank = self.head_dim, self.ps.tp_size, self.ps.tp_rank
        q_local, kv_local = self.num_heads * hd, self.num_kv_heads * hd
        q_total, kv_total = q_local * tp, kv_local * tp // self.kv_replicas
        check_dim(source, _out_dim(source), q_total + 2 * kv_total)
        kv_start = (tp_rank // self.kv_replicas) * kv_local
        parts = [  # (offset in param, start in checkpoint, size) of q, k, v
            (0, tp_rank * q_local, q_local),
            (q_local, q_total + kv_start, kv_local),
            (q_local + kv_local, q_total + kv_total + kv_start, kv_local),
        ]
        for offset, start, size in parts:
            copy_checked(
                param.data.narrow(0, offset, size),
                _out_slice(source, start, start + size),
                source.name,
            )


class Conv1DRowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` loaded from a Conv1D ``[in, out]`` weight (its rows are
    the input features) and a whole ``[out]`` bias."""

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        start = self.ps.tp_rank * self.in_local
        check_dim(source, 0, self.in_local * self.ps.tp_size)
        if len(source.shape) != 2:
            raise CheckpointError(f"tensor {source.name!r}: shape {list(source.shape)} is not 2-D")
        copy_checked(param.data, source.read(0, start, start + self.in_local).t(), source.name)
