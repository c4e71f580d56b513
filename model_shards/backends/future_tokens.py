"""Async scheduling's future tokens, read on the device.

A plan scheduled before the previous step's tokens reached the host carries, for a sequence
that follows on, the token id ``-(1 + i)``: the ``i``-th token the previous step sampled
(:mod:`model_shards.engine.scheduler.ahead`). The ids a step embeds are patched where they
already are, on the device, so no host round-trip sits between two steps.
"""

from __future__ import annotations

import torch


def read_future_tokens_(ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """In place: each id ``-(1 + i)`` of ``ids [n]`` (int64) becomes ``sampled[i]``
    (``sampled [S]``: the previous step's tokens, on ``ids``' device); returns ``ids``."""
    if sampled.shape[0] == 0:
        return ids
    index = (-1 - ids).clamp_(0, sampled.shape[0] - 1)  # [n]; ids >= 0 read row 0, unused
    return ids.copy_(torch.where(ids < 0, sampled[index], ids))
