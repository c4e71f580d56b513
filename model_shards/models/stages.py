"""Pipeline-parallel stage slicing: which contiguous layers each stage builds."""

from __future__ import annotations

import torch
from torch import nn


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of the layers stage ``pp_rank`` owns.

    Layers split as evenly as possible; the first ``num_layers % pp_size`` stages
    take one extra (the last stage also carries the norm and LM head).
    6 layers on 4 stages: (0, 2), (2, 4), (4, 5), (5, 6).
    """
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pipeline size {pp_size} must be in 1..{num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class MissingLayer(nn.Module):
    """Placeholder for a layer another stage owns: no parameters, never called."""

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("this layer lives on another pipeline stage")
