"""Qwen2.5-VL's multimodal rotary positions (M-RoPE) for one sequence: three position
streams (temporal, height, width) per prompt token (the ranks keep them per sequence:
``models/qwen2_5_vl_positions.py``; :func:`run_positions` from the media runs alone,
:func:`mrope_positions` from token types).

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
from dataclasses import dataclass

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
    runs: list[MediaRun] = []
    offset = 0
    for kind, run in itertools.groupby(token_types):
        length = len(list(run))
        if kind != TEXT:
            interval = tokens_per_second * next(seconds, 1.0) if kind == VIDEO else 1.0
            runs.append(MediaRun(offset, length, next(grids[kind]), interval))
        offset += length
    return run_positions(len(token_types), runs, merge)


@dataclass(frozen=True)
class MediaRun:
    """One image's or video's placeholder run: prompt positions ``offset .. offset +
    length - 1``, patch grid ``(t, h, w)``, ``interval``: the temporal position step per
    temporal patch (``tokens_per_second * second_per_grid`` for a video, 1 for an image)."""

    offset: int
    length: int
    grid: Grid
    interval: float = 1.0


def run_positions(
    num_tokens: int, runs: Sequence[MediaRun], merge: int
) -> tuple[torch.Tensor, int]:
    """M-RoPE ``(positions [3, num_tokens] long, delta)`` of a prompt whose media runs
    (in order, not overlapping, inside the prompt) are ``runs``; every other token is text."""
    parts: list[torch.Tensor] = []
    pos = prev = 0
    for run in [*runs, MediaRun(num_tokens, 0, (0, 0, 0))]:
        text = run.offset - prev
        if text < 0:
            raise ValueError(f"media run at {run.offset} overlaps the previous one")
        parts.append(torch.arange(text).view(1, -1).expand(3, -1) + pos)
        pos += text
        if run.length == 0:
            break
        t, h, w = run.grid
        gt, gh, gw = t, h // merge, w // merge
        if gt * gh * gw != run.length:
            raise ValueError(f"a run of {run.length} media tokens for a grid of {gt * gh * gw}")
        frames = (torch.arange(gt) * run.interval).long()
        tt, hh, ww = torch.meshgrid(
            frames, torch.arange(gh) + pos, torch.arange(gw) + pos, indexing="ij"
        )
        block = torch.stack([tt, hh, ww], dim=0).reshape(3, -1)  # [3, t * gh * gw]
        block[0] += pos
        parts.append(block)
        pos += max(h, w) // merge
        prev = run.offset + run.length
    positions = torch.cat(parts, dim=1)
    delta = int(positions.max()) + 1 - num_tokens if num_tokens else 0
    return positions, delta
