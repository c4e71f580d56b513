"""Column-parallel layers whose checkpoint tensor is already fused (Phi-3's ``qkv_proj``
and ``gate_up_proj``), each rank reading only its own rows of each part.

A fused checkpoint tensor stacks its parts along ``out``: ``W = [W_q; W_k; W_v]``
(``[(nh + 2 nkv) * D, H]``) or ``W = [W_gate; W_up]`` (``[2 I, H]``). Rank ``r`` needs
``[W_q,r; W_k,r; W_v,r]`` (or ``[W_gate,r; W_up,r]``): its slice of every part, exactly
what :class:`~model_shards.layers.linear.QKVParallelLinear` and
:class:`~model_shards.layers.linear.MergedColumnParallelLinear` load from separate
tensors. Here each part is a :class:`FusedPart` (the part's row range of the fused
tensor, read like a tensor of its own) handed to those layers' per-part loaders, so the
slicing is theirs and every read is ``fused.read(0, offset + start, offset + end)``.
The model's ``packed_modules_mapping`` maps nothing: the checkpoint names are the
parameter names.
"""

from __future__ import annotations

import torch
from torch import nn

from model_shards.layers.context import ShardContext
from model_shards.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    check_dim,
)
from model_shards.layers.loading import quant_of
from model_shards.worker.checkpoint import CheckpointError, TensorSource


class FusedPart(TensorSource):
    """Rows ``offset .. offset + rows - 1`` of a fused checkpoint tensor; only dim 0 slices.

    Shares nothing with :class:`TensorSource` but its interface (``name``, ``shape``,
    ``dtype``, ``read``): each read is one read of the fused tensor's rows.
    """

    def __init__(self, fused: TensorSource, offset: int, rows: int) -> None:
        self.fused, self.offset, self.rows = fused, offset, rows

    @property
    def name(self) -> str:
        return f"{self.fused.name}[{self.offset}:{self.offset + self.rows}]"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.fused.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.fused.dtype

    def read(self, dim: int = 0, start: int = 0, end: int | None = None) -> torch.Tensor:
        end = self.rows if end is None else end
        if dim != 0 or not 0 <= start <= end <= self.rows:
            raise CheckpointError(f"tensor {self.name!r}: slice {start}:{end} of dim {dim}")
        return self.fused.read(0, self.offset + start, self.offset + end)

    @property
    def ggml_type(self) -> int | None:
        """The fused tensor's GGML type (a GGUF source), else ``None``."""
        return getattr(self.fused, "ggml_type", None)

    def read_blocks(self, row_start: int, row_end: int) -> torch.Tensor:
        """Raw blocks of rows ``row_start .. row_end - 1`` of this part (GGUF sources)."""
        if not 0 <= row_start <= row_end <= self.rows:
            raise CheckpointError(f"tensor {self.name!r}: rows {row_start}:{row_end}")
        read = self.fused.read_blocks  # type: ignore[attr-defined]
        return read(self.offset + row_start, self.offset + row_end)


class FusedQKVParallelLinear(QKVParallelLinear):
    """:class:`QKVParallelLinear` loaded from one ``[(nh + 2 nkv) * D, in]`` tensor.

    ``head_order`` (``[D]``, optional): stored dim ``j`` of every q and k head is the
    checkpoint's dim ``head_order[j]`` (partial rotary, see
    :func:`~model_shards.layers.rotary.rotary_head_order`); v keeps its order.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        ctx: ShardContext,
        head_order: torch.Tensor | None = None,
    ) -> None:
        super().__init__(hidden_size, head_dim, num_heads, num_kv_heads, bias=bias, ctx=ctx)
        # rows of the fused tensor (all heads); the base class hands the parameters this
        # class's weight_loader
        self.q_rows, self.kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        self.head_order = head_order

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, source: TensorSource
    ) -> None:
        """Fill ``param`` (weight or bias) from the fused ``source``, this rank's rows only."""
        q, kv = self.q_rows, self.kv_rows
        check_dim(source, 0, q + 2 * kv)
        for shard_id, offset, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
            super().weight_loader(param, FusedPart(source, offset, rows), shard_id)
        if self.head_order is not None:
            d, heads = self.head_dim, self.num_heads + self.num_kv_heads
            held = quant_of(param)
            if held is not None:  # a quantized matrix: its q and k rows reordered as blocks
                starts = torch.arange(heads)[:, None] * d  # [nh + nkv, 1]
                held.permute_rows((starts + self.head_order[None, :]).reshape(-1))
                return
            qk = param.data.narrow(0, 0, heads * d)
            by_head = qk.view(-1, d, *qk.shape[1:])  # [nh + nkv, D, (in)]
            qk.copy_(by_head[:, self.head_order].reshape(qk.shape))


class FusedMergedColumnParallelLinear(MergedColumnParallelLinear):
    """:class:`MergedColumnParallelLinear` loaded from one ``[sum(out_sizes), in]`` tensor
    (Phi-3's ``gate_up_proj``: ``[gate; up]``). The base class hands its parameters this
    class's :meth:`weight_loader`."""

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, source: TensorSource
    ) -> None:
        """Fill ``param`` from the fused ``source``, this rank's rows of each part only."""
        check_dim(source, 0, sum(self.out_sizes))
        offset = 0
        for shard_id, rows in enumerate(self.out_sizes):
            super().weight_loader(param, FusedPart(source, offset, rows), shard_id)
            offset += rows
