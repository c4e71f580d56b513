"""Qwen2.5-VL vision tower: the index plans it runs on.

For each image or video of patch grid ``(t, h, w)`` (from the frontend's
``server/media/qwen2_5_vl/image.py``; patches arrive in merge-window order, ``m * m``
patches per merged token):

* :func:`vision_position_ids`: each patch's ``(row, column)`` for the ViT's 2D rotary.
* :func:`window_plan`: the merged-token permutation that groups tokens into
  ``window_size`` pixel windows, and the cumulative patch boundaries of those windows
  (windowed attention; the ``fullatt_block_indexes`` layers attend per image instead).

Both are transformers' ``get_vision_position_ids`` / ``get_vision_window_index``
(``transformers/vision_utils.py``) step for step, on CPU, ahead of the tower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Grid = tuple[int, int, int]


def vision_position_ids(grids: list[Grid], merge: int) -> torch.Tensor:
    """``[sum(t * h * w), 2]`` long: each patch's ``(row, column)`` in its frame."""
    out = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(block).transpose(1, 2).flatten()  # merge-window order
        cols = cols.reshape(block).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out, dim=0)


def window_plan(
    grids: list[Grid], merge: int, window_size: int, patch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(window_index [sum(t * h * w) / m**2] long, cu_window_seqlens [W + 1] int32)``:
    merged tokens in window order, and the windows' cumulative lengths in patches."""
    side = window_size // merge // patch_size  # merged tokens per window side
    index_parts: list[torch.Tensor] = []
    bounds = [0]
    offset = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4)
        padded = padded.reshape(t, nh * nw, side, side)  # [t, windows, side, side]
        lengths = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        index_parts.append(flat[flat != -100] + offset)
        bounds.extend((lengths.cumsum(0) * merge**2 + bounds[-1]).tolist())
        offset += t * gh * gw
    cu = torch.unique_consecutive(torch.tensor(bounds, dtype=torch.int32))
    return torch.cat(index_parts), cu
