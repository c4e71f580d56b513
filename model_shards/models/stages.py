"""Pipeline-parallel stage slicing: which contiguous layers each stage builds."""

from __future__ import annotations

import torch
from torch import nn


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
