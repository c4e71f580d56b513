"""Qwen2.5-VL's multimodal rotary positions (M-RoPE) for one sequence (work in progress,
issue 22): three position streams (temporal, height, width) per prompt token.

Text tokens count up by one on all three streams. An image or video run of grid
``(t, h, w)`` patches (``m * m`` patches per token) takes positions ``start + (T, row, col)``
over its merged ``t x h/m x w/m`` grid, ``T`` being the frame index (times
``tokens_per_second * second_per_grid`` for a video, truncated); the next text continues
from ``start + max(h, w) / m``. A decode token's three positions are all its sequence
position plus the prompt's ``delta = max(position) + 1 - len(prompt)``. This is
transformers' ``Qwen2_5_VLModel.get_rope_index`` step for step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2
Grid = tuple[int, int, int]


def mrope_positions(
    token_types: Sequence[int],
    image_grids: Sequence[Grid],
    video_grids: Sequence[Grid],
    merge: int,
    tokens_per_second: float = 1.0,
    second_per_grid: Sequence[float] = (),
) -> tuple[torch.Tensor, int]:
    """``token_types [L]`` (0 text, 1 image, 2 video; one run per image/video, in order)
    → ``(positions [3, L] long, delta)``."""
    grids = {IMAGE: iter(image_grids), VIDEO: iter(video_grids)}
    seconds = iter(second_per_grid)
    parts: list[torch.Tensor] = []
    pos = 0
    for kind, run in itertools.groupby(token_types):
        length = len(list(run))
        if kind == TEXT:
            parts.append(torch.arange(length).view(1, -1).expand(3, -1) + pos)
            pos += length
            continue
        t, h, w = next(grids[kind])
        interval = tokens_per_second * next(seconds, 1.0) if kind == VIDEO else 1.0
        gt, gh, gw = t, h // merge, w // merge
        if gt * gh * gw != length:
            raise ValueError(f"a run of {length} media tokens for a grid of {gt * gh * gw}")
        frames = (torch.arange(gt) * interval).long()
        tt, hh, ww = torch.meshgrid(
            frames, torch.arange(gh) + pos, torch.arange(gw) + pos, indexing="ij"
        )
        block = torch.stack([tt, hh, ww], dim=0).reshape(3, -1)  # [3, t * gh * gw]
        block[0] += pos
        parts.append(block)
        pos += max(h, w) // merge
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - len(token_types)
