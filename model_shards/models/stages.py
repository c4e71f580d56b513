"""Pipeline-parallel stage slicing: which contiguous layers each stage builds."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from model_shards.config.model import ModelConfig
from model_shards.layers.context import ShardContext


class LayerFactory(Protocol):
    """Builds decoder layer ``layer_idx`` (or one of its parts) on this rank: a layer class
    or a function (:func:`~model_shards.models.stack.dense_layers`)."""

    def __call__(self, cfg: ModelConfig, layer_idx: int, ctx: ShardContext) -> nn.Module: ...


def stage_layer_range(counts: list[int], pp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of the layers stage ``pp_rank`` owns, given layers per stage
    (``ModelConfig.layer_partition``). Counts ``[2, 2, 1, 1]``: (0, 2), (2, 4), (4, 5), (5, 6).
    """
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


class MissingLayer(nn.Module):
    """Placeholder for a layer another stage owns: no parameters, never called."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("this layer lives on another pipeline stage")


def stage_layers(
    cfg: ModelConfig, ctx: ShardContext, partition: str, layer: LayerFactory
) -> tuple[int, int, nn.ModuleList]:
    """This stage's ``[start, end)`` and all ``cfg.num_layers`` layers: ``layer(cfg, i, ctx)``
    for ``start <= i < end``, a :class:`MissingLayer` elsewhere (so parameter names keep the
    checkpoint's layer indices). ``partition``: see ``ModelConfig.layer_partition``."""
    counts = cfg.layer_partition(ctx.ps.pp_size, partition)
    start, end = stage_layer_range(counts, ctx.ps.pp_rank)
    layers = nn.ModuleList(
        layer(cfg, i, ctx) if start <= i < end else MissingLayer() for i in range(cfg.num_layers)
    )
    return start, end, layers
