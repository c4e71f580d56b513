"""RMSNorm, computed in float32 like the reference implementation."""

from __future__ import annotations

import torch
from torch import nn

from model_shards.layers.context import ShardContext
from model_shards.layers.linear import copy_checked, set_weight_loader
from model_shards.worker.checkpoint import TensorSource


class RMSNorm(nn.Module):
    """``y = w * x / sqrt(mean(x^2) + eps)``, the statistics in float32.

    Called with a residual, normalizes ``x + residual`` and returns ``(y, x + residual)``
    (the sum may be written into ``residual``); without, returns ``(y, x)``.
    """

    def __init__(self, hidden_size: int, eps: float, ctx: ShardContext) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ctx.ops
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        copy_checked(param.data, source.read(), source.name)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """``y = w * (x - mean) / sqrt(var + eps) + b`` (BERT, GPT-2), the statistics in float32.

    One ``F.layer_norm`` with the weight and bias fused, the kernel ``torch.nn.LayerNorm``
    (Hugging Face) runs: its rounding in every dtype (an unfused affine step afterwards
    differs from it by an ulp in float32)."""

    def __init__(self, hidden_size: int, eps: float, ctx: ShardContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=ctx.dtype), False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=ctx.dtype), False)
        set_weight_loader(self.weight, self.weight_loader)
        set_weight_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source: TensorSource) -> None:
        copy_checked(param.data, source.read(), source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
