"""Linear layers, replicated or split across the TP group (Megatron partitioning).

Weights are stored PyTorch-style, ``W: [out, in]``, ``Y = X W^T + b``.

* Column parallel: ``W = [W_1; …; W_p]`` split along ``out``; rank ``r`` computes
  ``Y_r = X W_r^T``, its own slice of the output columns. No communication.
* Row parallel: ``W = [W_1 … W_p]`` split along ``in``; rank ``r`` gets input
  slice ``X_r`` and computes ``X_r W_r^T``; the sum over ranks (all-reduce) is
  ``Y``. The bias is added once, after the reduction.

A column layer followed by a row layer (attention, MLP) needs one all-reduce.
Each parameter carries ``weight_loader(param, source[, shard_id])``, which
reads only this rank's slice from the checkpoint, kept dense or quantized
(:mod:`.loading`: GGUF blocks, ``--quantization``, the GEMM then
``ctx.ops.quantized_linear``; AWQ / GPTQ / FP8 checkpoints: :mod:`.checkpoint_quant`). The
GEMM is the backend's (``ctx.ops.linear``); after loading, :func:`prepare_weights` asks the
backend for a faster layout of each weight (the CPU backend's packed panels), kept beside
the parameter in ``packed`` (a quantized weight: its blocks reordered in place). A layer given
LoRA adapters (``lora``, :mod:`.lora`) adds their low-rank products to its output, before the
row-parallel all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from model_shards.backends.decode_stack import GemmParts
from model_shards.layers.checkpoint_quant import adopt_backend_form, checkpoint_gemm, ckpt_of
from model_shards.layers.context import ShardContext
from model_shards.layers.loading import check_dim, copy_checked, load_rows, quant_of
from model_shards.layers.lora import LoraWeights
from model_shards.parallel.comm import tp_all_reduce
from model_shards.worker.checkpoint import TensorSource

WeightLoader = Callable[..., None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


class LinearBase(nn.Module):
    """A module owning ``weight [out, in]``, used only through :meth:`gemm`."""

    weight: nn.Parameter
    ctx: ShardContext  # set by the subclass's constructor
    packed: object | None = None  # the backend's layout of ``weight``, set by prepare()
    bias_after_reduce = False  # forward adds ``bias`` to the GEMM's all-reduced output
    lora: LoraWeights | None = None  # multi-LoRA adapters, attached after loading

    def prepare(self) -> bool:
        """After loading: let the backend lay ``weight`` out for its GEMM; ``True`` if it did.
        A weight held quantized (:mod:`.loading`) is laid out in place (its blocks reordered,
        never dequantized; a tied embedding reads the same holder); a checkpoint-quantized one
        first takes the backend's form (:mod:`.checkpoint_quant`)."""
        adopt_backend_form(self.weight, self.ctx.ops, self.ctx.dtype)
        if ckpt_of(self.weight) is not None:
            return False
        quant = quant_of(self.weight)
        if quant is not None:
            return self.ctx.ops.pack_quantized(quant)
        self.packed = self.ctx.ops.pack_linear(self.weight)
        return self.packed is not None

    def gemm(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, in]`` → ``[T, out]``."""
        ckpt = ckpt_of(self.weight)
        if ckpt is not None:
            return checkpoint_gemm(self.ctx.ops, x, ckpt, bias)
        quant = quant_of(self.weight)
        if quant is not None:
            return self.ctx.ops.quantized_linear(x, quant, bias)
        return self.ctx.ops.linear(x, self.weight, self.packed, bias)

    def gemm_parts(self) -> GemmParts | None:
        """What :meth:`forward` multiplies by, for a backend's whole-step decode
        (:mod:`model_shards.backends.decode_stack`) at tensor parallel 1; ``None`` for a
        checkpoint-quantized weight (AWQ / GPTQ / FP8 parts) or one with LoRA adapters."""
        if ckpt_of(self.weight) is not None or self.lora is not None:
            return None
        bias: torch.Tensor | None = getattr(self, "bias", None)
        inside, after = (None, bias) if self.bias_after_reduce else (bias, None)
        return GemmParts(self.weight, self.packed, quant_of(self.weight), inside, after)


class HasModules(Protocol):
    """What :func:`prepare_weights` walks: an ``nn.Module``, or a model typed by its
    protocol (:class:`model_shards.models.DecoderModel`)."""

    def modules(self) -> Iterator[nn.Module]: ...


@runtime_checkable
class PreparesWeights(Protocol):
    """A module whose weights the backend may lay out after loading: every
    :class:`LinearBase`, and the stacked experts of an MoE layer (``layers/moe.py``)."""

    def prepare(self) -> bool: ...


def prepare_weights(model: HasModules) -> int:
    """``prepare()`` every module of ``model`` that has one (:class:`PreparesWeights`); how
    many were packed."""
    return sum(m.prepare() for m in model.modules() if isinstance(m, PreparesWeights))


class ReplicatedLinear(LinearBase):
    """The full matrix on every rank."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, ctx: ShardContext):
        super().__init__()
        self.ctx, dtype = ctx, ctx.dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False)
            set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        load_rows(self.ctx, param, 0, source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``[in] -> [out / tp]``: this rank's rows of ``W`` (output features)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, ctx: ShardContext):
        super().__init__()
        self.ctx, ps, dtype = ctx, ctx.ps, ctx.dtype
        if out_features % ps.tp_size:
            raise ValueError(f"output size {out_features} not divisible by tp={ps.tp_size}")
        self.ps = ps
        self.out_local = out_features // ps.tp_size
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features, dtype=dtype), False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_local, dtype=dtype), False)
            set_weight_loader(self.bias, self.weight_loader)

    def out_rows(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        """Where checkpoint part ``shard_id`` lands: ``(offset, total, start, size)``, its rows
        ``start .. start + size`` of ``total`` go to this rank's rows ``offset ..``."""
        total = self.out_local * self.ps.tp_size
        return 0, total, self.ps.tp_rank * self.out_local, self.out_local

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        offset, total, start, size = self.out_rows()
        check_dim(source, 0, total)
        load_rows(self.ctx, param, offset, source, 0, start, start + size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x, self.bias)  # [T, out / tp]
        if self.lora is not None:
            self.lora.add(x, y)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused along ``out`` (gate and up of an MLP).

    Rank ``r`` holds ``[A_r; B_r]`` — its slice of each — so the output splits
    cleanly into this rank's slice of each projection.
    """

    def __init__(
        self, in_features: int, out_sizes: Sequence[int], *, bias: bool, ctx: ShardContext
    ) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias, ctx=ctx)
        self.out_sizes = list(out_sizes)

    def out_rows(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        tp, i = self.ps.tp_size, int(shard_id or 0)
        size = self.out_sizes[i]
        local = size // tp
        return sum(self.out_sizes[:i]) // tp, size, self.ps.tp_rank * local, local

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, source: TensorSource, shard_id: int
    ) -> None:
        offset, total, start, size = self.out_rows(shard_id)
        check_dim(source, 0, total)
        load_rows(self.ctx, param, offset, source, 0, start, start + size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projections, split by attention heads.

    Each rank gets ``num_heads / tp`` query heads and ``max(1, num_kv_heads / tp)``
    key/value heads. When ``tp > num_kv_heads`` (``num_kv_heads`` must divide
    ``tp``) each KV head is replicated on ``tp / num_kv_heads`` consecutive ranks.
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
    ) -> None:
        tp = ctx.ps.tp_size
        if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(f"heads {num_heads}/{num_kv_heads} cannot be split over tp={tp}")
        self.head_dim = head_dim
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out_local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, out_local * tp, bias=bias, ctx=ctx)

    def out_rows(self, shard_id: int | str | None = None) -> tuple[int, int, int, int]:
        hd, tp_rank = self.head_dim, self.ps.tp_rank
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        if shard_id == "q":
            return 0, q_size * self.ps.tp_size, tp_rank * q_size, q_size
        offset = q_size if shard_id == "k" else q_size + kv_size
        total = kv_size * self.ps.tp_size // self.kv_replicas
        return offset, total, (tp_rank // self.kv_replicas) * kv_size, kv_size

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, source: TensorSource, shard_id: str
    ) -> None:
        offset, total, start, size = self.out_rows(shard_id)
        check_dim(source, 0, total)
        load_rows(self.ctx, param, offset, source, 0, start, start + size)


class RowParallelLinear(LinearBase):
    """``[in / tp] -> [out]``: this rank's columns of ``W``; outputs all-reduced."""

    bias_after_reduce = True

    def __init__(self, in_features: int, out_features: int, *, bias: bool, ctx: ShardContext):
        super().__init__()
        self.ctx, ps, dtype = ctx, ctx.ps, ctx.dtype
        if in_features % ps.tp_size:
            raise ValueError(f"input size {in_features} not divisible by tp={ps.tp_size}")
        self.ps = ps
        self.in_local = in_features // ps.tp_size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, dtype=dtype), False)
        set_weight_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False)
            set_weight_loader(self.bias, self.bias_loader)

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        start = self.ps.tp_rank * self.in_local
        check_dim(source, 1, self.in_local * self.ps.tp_size)
        load_rows(self.ctx, param, 0, source, 1, start, start + self.in_local)

    def bias_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        copy_checked(param.data, source.read(), source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gemm(x)  # [T, out], this rank's share of the sum
        if self.lora is not None:  # its A split along ``in`` as W is: a share of the sum too
            self.lora.add(x, y)
        y = tp_all_reduce(y, self.ctx.comm)  # [T, out]
        return y + self.bias if self.bias is not None else y
