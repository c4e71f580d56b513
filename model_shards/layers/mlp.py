"""The gated MLP, ``down(act(gate(x)) * up(x))``.

``gate_up_proj`` is gate and up in one column-parallel GEMM (rank ``r`` holds its rows of
each, ``[gate_r; up_r]``), ``down_proj`` row-parallel: one all-reduce per MLP.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from model_shards.layers.context import ShardContext
from model_shards.layers.fused_sources import FusedMergedColumnParallelLinear
from model_shards.layers.linear import MergedColumnParallelLinear, RowParallelLinear

# silu: the backend's fused silu_and_mul; gelu_tanh (Gemma): PyTorch's tanh-approximated GELU
Activation = Literal["silu", "gelu_tanh"]


class GatedMLP(nn.Module):
    """``x [T, H]`` → ``[T, H]``. ``fused_checkpoint``: gate and up are one checkpoint
    tensor ``gate_up_proj`` (Phi-3), else two (``gate_proj``, ``up_proj``: the model's
    ``packed_modules_mapping`` maps them)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        ctx: ShardContext,
        *,
        act: Activation = "silu",
        fused_checkpoint: bool = False,
    ) -> None:
        super().__init__()
        merged = FusedMergedColumnParallelLinear if fused_checkpoint else MergedColumnParallelLinear
        self.gate_up_proj = merged(hidden_size, [intermediate_size] * 2, bias=False, ctx=ctx)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, ctx=ctx)
        self.act = act
        self.ops = ctx.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._gated(x))  # [T, H]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of :meth:`forward`, ``[T, H]`` not yet summed over the TP group
        (a MoE block's shared expert: one all-reduce with the routed experts')."""
        return self.down_proj.gemm(self._gated(x))

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` → ``act(gate) * up: [T, I / tp]``; a plain dense SiLU projection
        (no LoRA, not quantized) through the backend's ``gated_linear`` (fusable)."""
        parts = self.gate_up_proj.gemm_parts() if self.act == "silu" else None
        if parts is not None and parts.quant is None and parts.bias is None:
            return self.ops.gated_linear(x, parts.weight, parts.packed)
        gate_up = self.gate_up_proj(x)  # [T, 2 I / tp]
        if self.act == "silu":
            return self.ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I / tp] each
        return F.gelu(gate, approximate="tanh") * up
