"""Qwen2.5-VL vision index plans (model_shards/models/qwen2_5_vl/vision.py) against
transformers' ``get_vision_position_ids`` / ``get_vision_window_index``."""

from __future__ import annotations

import torch

from model_shards.models.qwen2_5_vl.vision import vision_position_ids, window_plan

# images (t=1) and a 2-frame video, odd merged grids, one smaller than a window
GRIDS = [(1, 6, 10), (2, 8, 4), (1, 2, 2), (1, 14, 6)]


def test_position_ids_equal_transformers() -> None:
    from transformers.vision_utils import get_vision_position_ids

    want = get_vision_position_ids(torch.tensor(GRIDS), 2)
    got = vision_position_ids(GRIDS, 2)
    assert torch.equal(got, want)


def test_window_plan_equal_transformers() -> None:
    from transformers.vision_utils import get_vision_window_index

    for window_size, patch in ((112, 14), (56, 14), (32, 8)):
        want_index, want_cu = get_vision_window_index(torch.tensor(GRIDS), 2, window_size, patch)
        index, cu = window_plan(GRIDS, 2, window_size, patch)
        assert torch.equal(index, want_index)
        assert torch.equal(cu, want_cu) and cu.dtype == torch.int32
        assert sorted(index.tolist()) == list(range(sum(t * h * w for t, h, w in GRIDS) // 4))
